//! The verdicts of a suite of attacks. Each attack is judged and recorded
//! instead of failing the test at once, so one that gets through does not
//! hide the ones after it: run against older binaries (`WEFT_BIN_DIR`,
//! `WEFT_IMAGES_DIR`), the table says which attacks each version stops.

/// Attacks judged so far; [`Attacks::finish`] fails the test if any got through.
pub struct Attacks {
    suite: String,
    verdicts: Vec<(String, Option<String>)>,
}

impl Attacks {
    pub fn new(suite: &str) -> Self {
        Self { suite: suite.to_owned(), verdicts: Vec::new() }
    }

    /// Records `attack`: `held` when it failed as it should; otherwise
    /// `how` says what got through.
    pub fn judge(&mut self, attack: &str, held: bool, how: impl FnOnce() -> String) {
        let broke = (!held).then(how);
        match &broke {
            None => eprintln!("{}: attack held off: {attack}", self.suite),
            Some(how) => eprintln!("{}: ATTACK GOT THROUGH: {attack}: {how}", self.suite),
        }
        self.verdicts.push((attack.to_owned(), broke));
    }

    /// Prints the table; panics naming every attack that got through.
    pub fn finish(self) {
        eprintln!("\n{} | attack | verdict", self.suite);
        for (attack, broke) in &self.verdicts {
            eprintln!("| {attack} | {} |", if broke.is_some() { "got through" } else { "held off" });
        }
        let through: Vec<String> =
            self.verdicts.iter().filter_map(|(a, broke)| broke.as_ref().map(|how| format!("{a}: {how}"))).collect();
        assert!(
            through.is_empty(),
            "{} of {} attacks got through ({}):\n{}",
            through.len(),
            self.verdicts.len(),
            self.suite,
            through.join("\n")
        );
    }
}
