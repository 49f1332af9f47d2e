//! The container images `e2e/scripts/build-images.sh` builds without docker
//! (docker-archive tarballs for `ctr images import`): the agent image contains
//! every program the agent executes, both images carry their binaries where
//! the Dockerfile puts them and the Dockerfile's packages, user and entrypoint.
//!
//! The programs are collected from the agent's source (`node-agent/src`,
//! test code left out): each `Command::new("...")`, and each
//! `Command::new(NAME)` whose `NAME` is a `const NAME: &str = "..."` of the
//! same file. A `Command::new` of anything else fails the collection, so a new
//! program cannot slip past this test.
//!
//! The images come from `build-images.sh agent operator` (fast once its
//! Debian base layers are cached), or from `WEFT_AGENT_IMAGE` /
//! `WEFT_OPERATOR_IMAGE` when set to existing tarballs.
//!
//! The e2e test image agnhost (`target/images/agnhost.tar`, or
//! `WEFT_AGNHOST_IMAGE`) runs every tool Kubernetes' sig-network tests call
//! in it, as they call it; busybox, nginx, distroless-iptables and
//! regression-issue-74839 do what those tests have them do.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value;
use weft_e2e::prereq;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

// ---------------------------------------------------------------------------
// The programs the agent runs, from its source

/// `src` with comments blanked out (string literals kept), so commented-out
/// code and doc examples are not collected. Offsets stay the same.
fn strip_comments(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = b.to_vec();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                while i < b.len() && b[i] != b'\n' {
                    out[i] = b' ';
                    i += 1;
                }
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                let mut depth = 0;
                while i < b.len() {
                    if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                        depth += 1;
                        out[i] = b' ';
                        out[i + 1] = b' ';
                        i += 2;
                    } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                        depth -= 1;
                        out[i] = b' ';
                        out[i + 1] = b' ';
                        i += 2;
                        if depth == 0 {
                            break;
                        }
                    } else {
                        if b[i] != b'\n' {
                            out[i] = b' ';
                        }
                        i += 1;
                    }
                }
            }
            b'"' => i = string_end(b, i),
            b'r' if (b.get(i + 1) == Some(&b'"') || b.get(i + 1) == Some(&b'#'))
                && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')) =>
            {
                i = raw_string_end(b, i);
            }
            // A char literal such as '"' (lifetimes have no closing quote).
            b'\'' if b.get(i + 2) == Some(&b'\'') => i += 3,
            b'\'' if b.get(i + 1) == Some(&b'\\') => {
                i += 2;
                while i < b.len() && b[i] != b'\'' {
                    i += 1;
                }
                i += 1;
            }
            _ => i += 1,
        }
    }
    String::from_utf8(out).expect("only ASCII bytes were replaced")
}

/// Index just past the string literal starting at `b[start] == '"'`.
fn string_end(b: &[u8], start: usize) -> usize {
    let mut i = start + 1;
    while i < b.len() {
        match b[i] {
            b'\\' => i += 2,
            b'"' => return i + 1,
            _ => i += 1,
        }
    }
    b.len()
}

/// Index just past the raw string literal `r#*"..."#*` starting at `b[start] == 'r'`.
fn raw_string_end(b: &[u8], start: usize) -> usize {
    let mut i = start + 1;
    let mut hashes = 0;
    while b.get(i) == Some(&b'#') {
        hashes += 1;
        i += 1;
    }
    if b.get(i) != Some(&b'"') {
        return start + 1; // an identifier such as `r#type`
    }
    i += 1;
    while i < b.len() {
        if b[i] == b'"' && b[i + 1..].iter().take(hashes).filter(|&&c| c == b'#').count() == hashes {
            return i + 1 + hashes;
        }
        i += 1;
    }
    b.len()
}

/// Index just past the item starting at `start`: its `;` or its closing `}`.
fn item_end(b: &[u8], start: usize) -> usize {
    let mut depth = 0usize;
    let mut i = start;
    while i < b.len() {
        match b[i] {
            b'"' => {
                i = string_end(b, i);
                continue;
            }
            b'{' => depth += 1,
            b'}' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return i + 1;
                }
            }
            b';' if depth == 0 => return i + 1,
            _ => {}
        }
        i += 1;
    }
    b.len()
}

/// The string literal at the start of `s` (after whitespace), unescaped
/// only as far as program names need.
fn leading_literal(s: &str) -> Option<&str> {
    let s = s.trim_start().strip_prefix('"')?;
    let end = s.find('"')?;
    Some(&s[..end])
}

/// The identifier at the start of `s` (after whitespace).
fn leading_ident(s: &str) -> &str {
    let s = s.trim_start();
    let end = s.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(s.len());
    &s[..end]
}

/// `code` with the insides of string literals blanked (quotes kept), so
/// text in strings is not taken for code. Offsets stay the same.
fn mask_strings(code: &str) -> String {
    let b = code.as_bytes();
    let mut out = b.to_vec();
    let mut i = 0;
    while i < b.len() {
        let end = match b[i] {
            b'"' => string_end(b, i),
            b'r' if (b.get(i + 1) == Some(&b'"') || b.get(i + 1) == Some(&b'#'))
                && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')) =>
            {
                raw_string_end(b, i)
            }
            b'\'' if b.get(i + 2) == Some(&b'\'') => i + 3,
            _ => {
                i += 1;
                continue;
            }
        };
        let open = i + b[i..end].iter().position(|&c| c == b'"' || c == b'\'').unwrap_or(0);
        let close = end - 1 - b[..end].iter().rev().take_while(|&&c| c == b'#').count();
        for c in out.iter_mut().take(close).skip(open + 1) {
            *c = b' ';
        }
        i = end.max(i + 1);
    }
    String::from_utf8(out).expect("only whole literals' bytes were replaced")
}

/// One source file with test-only items removed: the programs it runs, the
/// `Command::new` arguments it cannot name, and the files its
/// `#[cfg(test)] mod name;` items declare (test code too).
struct Scanned {
    programs: BTreeSet<String>,
    unknown: Vec<String>,
    test_modules: Vec<PathBuf>,
}

/// Scans `src`, the text of `file` (used for messages and `mod` paths).
/// Calls whose first argument is the program to run.
const LAUNCHERS: [&str; 3] = ["Command::new(", "exec::run(", "exec::run_ok("];

fn scan_source(file: &Path, src: &str) -> Scanned {
    let mut code = strip_comments(src);
    let mut masked = mask_strings(&code);
    let mut test_modules = Vec::new();
    // The directory a `mod name;` of this file is looked up in.
    let stem = file.file_stem().and_then(|s| s.to_str()).unwrap_or_default();
    let parent = file.parent().unwrap_or(Path::new(""));
    let mod_dir = if matches!(stem, "mod" | "main" | "lib") { parent.to_path_buf() } else { parent.join(stem) };
    // Blank out every #[cfg(test)] item, remembering the files of `mod x;`.
    while let Some(at) = masked.find("#[cfg(test)]") {
        let b = masked.as_bytes();
        let mut i = at + "#[cfg(test)]".len();
        let mut path_attr = None;
        loop {
            while i < b.len() && b[i].is_ascii_whitespace() {
                i += 1;
            }
            if b.get(i) != Some(&b'#') {
                break;
            }
            let close = masked[i..].find(']').map_or(b.len(), |j| i + j + 1);
            if masked[i..close].starts_with("#[path") {
                let value = &code[i + "#[path".len()..close];
                path_attr = leading_literal(value.trim_start().trim_start_matches('=')).map(str::to_owned);
            }
            i = close;
        }
        let end = item_end(b, i);
        let item = masked[i..end].trim();
        if let Some(decl) = item.strip_prefix("mod ").or_else(|| item.strip_prefix("pub mod "))
            && decl.ends_with(';')
        {
            let name = leading_ident(decl);
            match &path_attr {
                Some(p) => test_modules.push(parent.join(p)),
                None => {
                    test_modules.push(mod_dir.join(format!("{name}.rs")));
                    test_modules.push(mod_dir.join(name).join("mod.rs"));
                }
            }
        }
        let blank = " ".repeat(end - at);
        code.replace_range(at..end, &blank);
        masked.replace_range(at..end, &blank);
    }
    // const NAME: &str = "value", with where it is (one file may have a
    // function-local `const CMD` in each of several functions).
    let mut consts = Vec::new();
    for (at, _) in masked.match_indices("const ") {
        let rest = &masked[at + "const ".len()..];
        let name = leading_ident(rest);
        let rest = rest[name.len()..].trim_start();
        let Some(rest) = rest.strip_prefix(':') else { continue };
        let rest = rest.trim_start();
        let Some(rest) = rest.strip_prefix("&str").or_else(|| rest.strip_prefix("&'static str")) else { continue };
        let Some(rest) = rest.trim_start().strip_prefix('=') else { continue };
        let value_at = code.len() - rest.len();
        if let Some(value) = leading_literal(&code[value_at..]) {
            consts.push((at, name.to_owned(), value.to_owned()));
        }
    }
    let mut programs = BTreeSet::new();
    let mut unknown = Vec::new();
    // `dataplane::exec` runs the program its caller names (with a deadline):
    // its calls name programs as `Command::new` does, and its own
    // `Command::new(cmd)` only forwards them.
    let forwards = code.contains("pub fn run(cmd: &'static str");
    let calls = LAUNCHERS.iter().flat_map(|l| masked.match_indices(l).map(move |(at, _)| (at, l.len())));
    for (at, len) in calls.collect::<Vec<_>>() {
        let arg_at = at + len;
        let arg = &code[arg_at..];
        if forwards && leading_ident(arg) == "cmd" {
            continue;
        }
        if let Some(lit) = leading_literal(arg) {
            programs.insert(lit.to_owned());
            continue;
        }
        let ident = leading_ident(arg);
        // The nearest definition before the use, else the first after it.
        let named = |&(_, name, _): &&(usize, String, String)| name == ident;
        let def = consts.iter().rev().filter(|c| c.0 < at).find(named).or_else(|| consts.iter().find(named));
        match def.map(|(_, _, value)| value) {
            Some(value) if arg.trim_start()[ident.len()..].trim_start().starts_with(')') => {
                programs.insert(value.clone());
            }
            _ => unknown.push(format!(
                "{}:{}: `Command::new({}…`",
                file.display(),
                code[..at].lines().count(),
                arg.trim_start().chars().take(30).collect::<String>()
            )),
        }
    }
    Scanned { programs, unknown, test_modules }
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            rust_files(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    Ok(())
}

/// Every program the agent executes, from `node-agent/src` without its tests.
fn agent_programs() -> Result<BTreeSet<String>> {
    let src = repo_root().join("node-agent/src");
    let mut files = Vec::new();
    rust_files(&src, &mut files)?;
    files.sort();
    let mut scanned = BTreeMap::new();
    let mut test_files = BTreeSet::new();
    for file in &files {
        let text = std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
        let s = scan_source(file, &text);
        test_files.extend(s.test_modules.iter().cloned());
        scanned.insert(file.clone(), s);
    }
    // A test module's own submodules are test code as well.
    let is_test = |f: &Path| {
        test_files.iter().any(|t| {
            let dir = if t.file_name().is_some_and(|n| n == "mod.rs") { t.parent() } else { None };
            f == t || f.starts_with(dir.map_or_else(|| t.with_extension(""), Path::to_path_buf))
        })
    };
    let agent: Vec<Scanned> = scanned.into_iter().filter(|(f, _)| !is_test(f)).map(|(_, s)| s).collect();
    let unknown: Vec<&String> = agent.iter().flat_map(|s| &s.unknown).collect();
    ensure!(
        unknown.is_empty(),
        "cannot tell which program these run (use a string literal, or a `const NAME: &str` of the same file): {unknown:?}"
    );
    Ok(agent.into_iter().flat_map(|s| s.programs).collect())
}

#[test]
fn scanner_finds_literals_and_consts_and_skips_tests() {
    let src = r#"
        //! Runs `Command::new("documented")`.
        use std::process::Command;
        #[cfg(test)]
        mod kernel_tests;
        #[cfg(test)]
        #[path = "x_tests.rs"]
        mod x;
        fn restore() {
            const CMD: &str = "iptables-restore";
            let _ = Command::new(CMD).arg("-w");
        }
        fn save() {
            const CMD: &str = "iptables-save";
            let _ = Command::new(CMD).arg("-c");
            let _ = tokio::process::Command::new(
                "ipset",
            );
            // Command::new("commented")
            let s = "Command::new(\"in a string\")"; let _ = s;
        }
        #[cfg(test)]
        mod tests {
            fn t() { let _ = std::process::Command::new("ip").arg("}"); }
        }
        fn after() { let _ = Command::new("conntrack"); }
        fn helper() { let _ = exec::run_ok("nft", &["list"], None, T, &[]); }
    "#;
    let s = scan_source(Path::new("src/dataplane/iptables.rs"), src);
    assert_eq!(s.programs, ["conntrack", "iptables-restore", "iptables-save", "ipset", "nft"].map(String::from).into());
    assert!(s.unknown.is_empty(), "{:?}", s.unknown);
    assert!(s.test_modules.contains(&PathBuf::from("src/dataplane/iptables/kernel_tests.rs")));
    assert!(s.test_modules.contains(&PathBuf::from("src/dataplane/x_tests.rs")));
    let s = scan_source(Path::new("a.rs"), "fn f(p: &str) {\n Command::new(p); }");
    assert_eq!(s.unknown, ["a.rs:2: `Command::new(p); }…`"]);
}

#[test]
fn agent_programs_are_collected_from_the_source() {
    let programs = agent_programs().expect("collect");
    for want in ["nft", "iptables-restore", "iptables-save", "ipset", "conntrack"] {
        assert!(programs.contains(want), "{want} not collected from node-agent/src: {programs:?}");
    }
    // Only the kernel tests run `ip`; the agent speaks netlink itself.
    assert!(!programs.contains("ip"), "test code was collected: {programs:?}");
}

// ---------------------------------------------------------------------------
// The Dockerfile

struct Stage {
    packages: Vec<String>,
    user: String,
    entrypoint: Value,
}

/// The runtime packages, USER and ENTRYPOINT of the Dockerfile's stage `name`.
fn dockerfile_stage(name: &str) -> Result<Stage> {
    let text = std::fs::read_to_string(repo_root().join("Dockerfile")).context("reading the Dockerfile")?;
    let joined = text.lines().filter(|l| !l.trim_start().starts_with('#')).collect::<Vec<_>>().join("\n");
    let joined = joined.replace("\\\n", " ");
    let mut inside = false;
    let mut stage = Stage { packages: Vec::new(), user: String::new(), entrypoint: Value::Null };
    for line in joined.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.first().map(|w| w.to_ascii_uppercase()).as_deref() {
            Some("FROM") => {
                inside = words.len() >= 4
                    && words[words.len() - 2].eq_ignore_ascii_case("as")
                    && words[words.len() - 1] == name
            }
            Some("RUN") if inside => {
                if let Some((_, pkgs)) = line.split_once("--no-install-recommends") {
                    stage.packages = pkgs
                        .split_whitespace()
                        .take_while(|w| !matches!(*w, "&&" | ";" | "|"))
                        .filter(|w| !w.starts_with('-'))
                        .map(str::to_owned)
                        .collect();
                }
            }
            Some("USER") if inside => stage.user = words.get(1).copied().unwrap_or_default().to_owned(),
            Some("ENTRYPOINT") if inside => {
                let json = line.trim_start()["ENTRYPOINT".len()..].trim();
                stage.entrypoint =
                    serde_json::from_str(json).with_context(|| format!("ENTRYPOINT of {name}: {json}"))?;
            }
            _ => {}
        }
    }
    ensure!(!stage.packages.is_empty(), "stage {name}: no `apt-get install ... --no-install-recommends <pkgs>`");
    ensure!(!stage.user.is_empty(), "stage {name}: no USER");
    ensure!(stage.entrypoint.is_array(), "stage {name}: no ENTRYPOINT in exec form");
    Ok(stage)
}

// ---------------------------------------------------------------------------
// Images

#[derive(Debug, Clone, PartialEq)]
enum Kind {
    Dir,
    File { mode: String },
    Symlink(String),
    Hardlink(String),
    Other,
}

#[derive(Debug, Clone)]
struct Entry {
    kind: Kind,
    owner: String,
}

/// A docker-archive image: its manifest entry, config, and the union of its
/// layers' listings (paths without a leading `/`).
struct Image {
    archive: PathBuf,
    manifest: Value,
    config: Value,
    files: BTreeMap<String, Entry>,
}

fn sh(script: &str, args: &[&Path]) -> Result<Vec<u8>> {
    let out = Command::new("sh").arg("-c").arg(script).arg("sh").args(args).output().context("running sh")?;
    ensure!(out.status.success(), "`{script}` failed: {}", String::from_utf8_lossy(&out.stderr));
    Ok(out.stdout)
}

fn normalize(path: &str) -> String {
    path.trim_start_matches("./").trim_start_matches('/').trim_end_matches('/').to_owned()
}

/// Parses one line of GNU `tar -tv --numeric-owner`.
fn parse_listing_line(line: &str) -> Option<(String, Entry)> {
    let mut rest = line;
    let mut fields = Vec::new();
    for _ in 0..5 {
        rest = rest.trim_start();
        let end = rest.find(' ')?;
        fields.push(&rest[..end]);
        rest = &rest[end..];
    }
    let name = rest.trim_start();
    let (mode, owner) = (fields[0], fields[1]);
    let (name, kind) = match mode.as_bytes().first()? {
        b'd' => (name, Kind::Dir),
        b'l' => {
            let (n, t) = name.split_once(" -> ")?;
            (n, Kind::Symlink(t.to_owned()))
        }
        b'h' | b'-' if name.contains(" link to ") => {
            let (n, t) = name.split_once(" link to ")?;
            (n, Kind::Hardlink(normalize(t)))
        }
        b'-' => (name, Kind::File { mode: mode.to_owned() }),
        _ => (name, Kind::Other),
    };
    Some((normalize(name), Entry { kind, owner: owner.to_owned() }))
}

impl Image {
    fn load(archive: &Path) -> Result<Self> {
        let manifest: Value =
            serde_json::from_slice(&sh(r#"tar -xOf "$1" manifest.json"#, &[archive])?).context("manifest.json")?;
        let entry = manifest.get(0).context("manifest.json lists no image")?.clone();
        let config_name = entry["Config"].as_str().context("no Config")?;
        let config_bytes = sh(&format!(r#"tar -xOf "$1" '{config_name}'"#), &[archive])?;
        let config: Value = serde_json::from_slice(&config_bytes).context("config JSON")?;
        let layers: Vec<&str> =
            entry["Layers"].as_array().context("no Layers")?.iter().filter_map(Value::as_str).collect();
        let diff_ids = config["rootfs"]["diff_ids"].as_array().context("no rootfs.diff_ids")?;
        ensure!(layers.len() == diff_ids.len(), "{} layers but {} diff_ids", layers.len(), diff_ids.len());
        let mut files = BTreeMap::new();
        for (layer, diff_id) in layers.iter().zip(diff_ids) {
            let out = sh(&format!(r#"tar -xOf "$1" '{layer}' | tar --numeric-owner -tvf -"#), &[archive])?;
            let listing = String::from_utf8_lossy(&out);
            for line in listing.lines() {
                let (name, e) = parse_listing_line(line).with_context(|| format!("tar listing line {line:?}"))?;
                if name.is_empty() {
                    continue;
                }
                let base = name.rsplit('/').next().unwrap_or_default();
                if let Some(hidden) = base.strip_prefix(".wh.") {
                    let dir = name[..name.len() - base.len()].to_owned();
                    if hidden == ".wh..opq" {
                        files.retain(|k: &String, _| !k.starts_with(&dir) || *k == dir.trim_end_matches('/'));
                    } else {
                        let gone = format!("{dir}{hidden}");
                        files.retain(|k: &String, _| *k != gone && !k.starts_with(&format!("{gone}/")));
                    }
                    continue;
                }
                files.insert(name, e);
            }
            let digest = sh(&format!(r#"tar -xOf "$1" '{layer}' | sha256sum"#), &[archive])?;
            let digest = String::from_utf8_lossy(&digest);
            let digest = digest.split_whitespace().next().unwrap_or_default();
            ensure!(
                diff_id.as_str() == Some(&format!("sha256:{digest}")),
                "layer {layer}: sha256 {digest} is not its diff_id {diff_id}"
            );
            ensure!(layer.starts_with(digest), "layer {layer} is not named by its digest");
        }
        Ok(Image { archive: archive.to_owned(), manifest: entry, config, files })
    }

    /// `path` with every symlink resolved inside the image, or `None` when
    /// some component does not exist (a dangling link) or a link loops.
    fn resolve(&self, path: &str) -> Option<String> {
        let mut todo: VecDeque<String> = path.split('/').map(str::to_owned).collect();
        let mut cur: Vec<String> = Vec::new();
        let mut hops = 0;
        while let Some(c) = todo.pop_front() {
            match c.as_str() {
                "" | "." => continue,
                ".." => {
                    cur.pop();
                    continue;
                }
                _ => {}
            }
            cur.push(c);
            let p = cur.join("/");
            match &self.files.get(&p)?.kind {
                Kind::Symlink(target) => {
                    hops += 1;
                    if hops > 40 {
                        return None;
                    }
                    cur.pop();
                    if target.starts_with('/') {
                        cur.clear();
                    }
                    for part in target.split('/').rev() {
                        todo.push_front(part.to_owned());
                    }
                }
                Kind::Hardlink(target) if todo.is_empty() => return self.resolve(target),
                Kind::Dir => {}
                _ if todo.is_empty() => {}
                _ => return None,
            }
        }
        Some(cur.join("/"))
    }

    /// True when `path` resolves to an executable regular file of the image.
    fn is_executable(&self, path: &str) -> bool {
        let Some(real) = self.resolve(path) else { return false };
        matches!(&self.files.get(&real).map(|e| &e.kind), Some(Kind::File { mode }) if mode.as_bytes().get(3) == Some(&b'x'))
    }

    fn repo_tag(&self) -> &str {
        self.manifest["RepoTags"][0].as_str().unwrap_or_default()
    }

    /// The text of `path` (resolved) from the last layer that has it.
    fn read(&self, path: &str) -> Result<String> {
        let real = self.resolve(path).with_context(|| format!("{path} is not in the image"))?;
        let layers: Vec<&str> =
            self.manifest["Layers"].as_array().context("Layers")?.iter().filter_map(Value::as_str).collect();
        for layer in layers.iter().rev() {
            let out = Command::new("sh")
                .arg("-c")
                .arg(format!(r#"tar -xOf "$1" '{layer}' | tar -xOf - '{real}' './{real}' 2>/dev/null"#))
                .arg("sh")
                .arg(&self.archive)
                .output()?;
            if !out.stdout.is_empty() {
                return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
            }
        }
        bail!("cannot read {real} from {}", self.archive.display())
    }
}

/// The program's location in the image: the first of the Dockerfile PATH
/// directories where it resolves to an executable file.
fn find_program(image: &Image, program: &str) -> Option<String> {
    ["usr/local/bin", "usr/sbin", "usr/bin", "sbin", "bin"]
        .iter()
        .map(|dir| format!("{dir}/{program}"))
        .find(|p| image.is_executable(p))
}

/// The agent and operator archives: `WEFT_AGENT_IMAGE` / `WEFT_OPERATOR_IMAGE`
/// when set, the others built now by `build-images.sh`.
fn images() -> Option<(PathBuf, PathBuf)> {
    let given = |var: &str| std::env::var_os(var).map(PathBuf::from);
    let mut found = BTreeMap::new();
    for (stage, var) in [("agent", "WEFT_AGENT_IMAGE"), ("operator", "WEFT_OPERATOR_IMAGE")] {
        if let Some(path) = given(var) {
            assert!(path.is_file(), "{var}={} is not a file", path.display());
            found.insert(stage, path);
        }
    }
    let missing: Vec<&str> = ["agent", "operator"].into_iter().filter(|s| !found.contains_key(s)).collect();
    if !missing.is_empty() {
        // The script needs root (mmdebstrap, apt-get) and the built daemons.
        if !prereq::require_root() {
            return None;
        }
        let target = given("CARGO_TARGET_DIR").unwrap_or_else(|| repo_root().join("target"));
        let bin_dir = given("WEFT_BIN_DIR").unwrap_or_else(|| target.join("debug"));
        for stage in &missing {
            let bin = bin_dir.join(format!("weft-{stage}"));
            let what = format!("{} (cargo build -p weft-{stage}, or set WEFT_BIN_DIR)", bin.display());
            if !prereq::require(&what, bin.is_file()) {
                return None;
            }
        }
        let out = Command::new(repo_root().join("e2e/scripts/build-images.sh"))
            .args(&missing)
            .env("WEFT_BIN_DIR", &bin_dir)
            .env("WEFT_IMAGES_DIR", target.join("images-test"))
            .env("WEFT_IMAGE_TAG", "images-test")
            .output()
            .expect("run e2e/scripts/build-images.sh");
        assert!(out.status.success(), "build-images.sh failed:\n{}", String::from_utf8_lossy(&out.stderr));
        let printed: BTreeMap<String, PathBuf> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split_once(' ').map(|(r, p)| (r.to_owned(), PathBuf::from(p))))
            .collect();
        for stage in missing {
            let reference = format!("ghcr.io/weft/weft-{stage}:images-test");
            let path = printed.get(&reference).unwrap_or_else(|| panic!("{reference} not printed: {printed:?}"));
            found.insert(stage, path.clone());
        }
    }
    Some((found.remove("agent")?, found.remove("operator")?))
}

fn check_weft_image(image: &Image, stage_name: &str, repo: &str, binaries: &[&str]) -> Result<()> {
    let stage = dockerfile_stage(stage_name)?;
    ensure!(
        image.repo_tag().starts_with(&format!("{repo}:")),
        "{}: RepoTags {}",
        image.archive.display(),
        image.repo_tag()
    );
    ensure!(image.config["architecture"] == "amd64" && image.config["os"] == "linux", "platform: {}", image.config);
    let config = &image.config["config"];
    ensure!(
        config["Entrypoint"] == stage.entrypoint,
        "{repo}: Entrypoint {} but the Dockerfile says {}",
        config["Entrypoint"],
        stage.entrypoint
    );
    ensure!(
        config["User"] == stage.user.as_str(),
        "{repo}: User {} but the Dockerfile says {}",
        config["User"],
        stage.user
    );
    for bin in binaries {
        let path = format!("usr/local/bin/{bin}");
        let entry = image.files.get(&path).with_context(|| format!("{repo} has no /{path}"))?;
        ensure!(image.is_executable(&path), "{repo}: /{path} is not an executable file: {entry:?}");
        ensure!(entry.owner == "0/0", "{repo}: /{path} is owned by {}, not root", entry.owner);
    }
    // The Dockerfile's runtime packages are installed.
    let status = image.read("var/lib/dpkg/status")?;
    let installed: BTreeSet<&str> = status
        .split("\n\n")
        .filter(|p| p.lines().any(|l| l == "Status: install ok installed"))
        .filter_map(|p| p.lines().find_map(|l| l.strip_prefix("Package: ")))
        .collect();
    for pkg in &stage.packages {
        ensure!(installed.contains(pkg.as_str()), "{repo}: Debian package {pkg} (Dockerfile) is not installed");
    }
    Ok(())
}

#[test]
fn images_contain_what_the_dockerfile_and_the_agent_need() {
    let Some((agent, operator)) = images() else { return };
    let agent = Image::load(&agent).expect("agent image");
    let operator = Image::load(&operator).expect("operator image");
    check_weft_image(&agent, "agent", "ghcr.io/weft/weft-agent", &["weft-agent", "weft-cni", "weft"])
        .expect("agent image");
    check_weft_image(&operator, "operator", "ghcr.io/weft/weft-operator", &["weft-operator"]).expect("operator image");

    // Every program the agent executes, with its Debian alternatives links
    // (/usr/sbin/iptables-restore -> /etc/alternatives/... -> xtables-nft-multi)
    // resolving inside the image.
    let programs = agent_programs().expect("collect the agent's programs");
    let mut missing = Vec::new();
    for program in &programs {
        match find_program(&agent, program) {
            Some(at) => eprintln!("agent image: {program} at /{at} -> /{}", agent.resolve(&at).unwrap_or_default()),
            None => missing.push(program.as_str()),
        }
    }
    assert!(
        missing.is_empty(),
        "the agent image lacks programs the agent runs: {missing:?} (add their packages to the Dockerfile's agent stage)"
    );
}

/// What the upstream sig-network tests run inside agnhost pods, run in the
/// image we build (its layers unpacked, chrooted in fresh network and UTS
/// namespaces): each tool as the tests call it, against agnhost's own
/// servers and the image's `/coredns`.
const AGNHOST_TOOLS_SCRIPT: &str = r#"
set -eu
hostname agnhost-check
ip link set lo up
/agnhost netexec --http-port=8080 --udp-port=8081 >/tmp/netexec.log 2>&1 &
/agnhost serve-hostname --port=9376 --http=true >/tmp/serve-hostname.log 2>&1 &
printf '. {\n  hosts {\n    10.1.2.3 probe.example\n  }\n}\n' >/tmp/Corefile
/coredns -conf /tmp/Corefile >/tmp/coredns.log 2>&1 &
# The servers take a moment to listen: poll each, up to 10 s.
ready() { for _ in $(seq 200); do "$@" >/dev/null 2>&1 && return 0; sleep 0.05; done; echo "never ready: $*"; exit 1; }
ready curl -sf http://127.0.0.1:8080/hostname
ready curl -sf http://127.0.0.1:9376/
ready dig +short +time=1 +tries=1 @127.0.0.1 probe.example
check() { want=$1; shift; got=$("$@" 2>&1) || { echo "FAIL ($?): $* -> $got"; exit 1; }
  case $got in *"$want"*) echo "ok: $*";; *) echo "FAIL: $* -> $got (wanted $want)"; exit 1;; esac; }
check agnhost-check wget -q -O - -T 1 http://127.0.0.1:8080/hostname
check agnhost-check wget -T 5 -qO- http://127.0.0.1:8080/hostname
check agnhost-check curl -s --max-time 1 http://127.0.0.1:8080/hostname
check agnhost-check curl -s http://127.0.0.1:9376/
check succeeded nc -vz -w 1 127.0.0.1 8080
check agnhost-check sh -c 'echo hostname | nc -u -w 1 127.0.0.1 8081'
check 10.1.2.3 dig +short +time=1 +tries=1 @127.0.0.1 probe.example
check 10.1.2.3 nslookup probe.example 127.0.0.1
echo 'nameserver 127.0.0.1' >/etc/resolv.conf
check 10.1.2.3 getent hosts probe.example
check 10.1.2.3 nslookup probe.example
check 8080 ss -ltn
check "1 packets received" ping -c 1 -W 1 127.0.0.1
# Failures fail as upstream's loops expect (non-zero, within the timeout).
if wget -q -O - -T 1 http://127.0.0.1:1/ >/dev/null 2>&1; then echo "FAIL: wget to a closed port succeeded"; exit 1; fi
echo "all tools work"
"#;

/// Runs `script` with `shell` inside the image `target/images/<name>.tar`
/// (or the file `env` names, when set): its layers unpacked, chrooted in fresh network,
/// UTS, PID and mount namespaces. `None` when the prerequisites are missing
/// (and not on CI); otherwise whether it succeeded, and its output.
fn run_in_image(name: &str, env: Option<&str>, shell: &str, script: &str) -> Option<(bool, String)> {
    if !prereq::require_root() {
        return None;
    }
    let archive = env
        .and_then(std::env::var_os)
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join(format!("target/images/{name}.tar")));
    let what = format!("{} (e2e/scripts/build-images.sh)", archive.display());
    if !prereq::require(&what, archive.is_file()) {
        return None;
    }
    let image = Image::load(&archive).expect("image");
    let root = tempfile::tempdir().expect("temporary directory");
    for layer in image.manifest["Layers"].as_array().expect("Layers").iter().filter_map(Value::as_str) {
        sh(&format!(r#"tar -xOf "$1" '{layer}' | tar --numeric-owner -xf - -C "$2""#), &[&archive, root.path()])
            .expect("unpack a layer");
    }
    let out = Command::new("unshare")
        // A PID namespace: its servers die with the script. The image has
        // no device nodes (the runtime's business): the host's /dev, bound
        // in a mount namespace of its own.
        .args(["--net", "--uts", "--pid", "--mount", "--fork", "--kill-child"])
        .args([
            "sh",
            "-c",
            r#"mkdir -p "$1/dev" && mount --rbind /dev "$1/dev" && exec chroot "$1" "$2" -c "$3""#,
            "sh",
        ])
        .arg(root.path())
        .arg(shell)
        .arg(script)
        .output()
        .expect("run unshare");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    Some((out.status.success(), text))
}

#[test]
fn agnhost_runs_the_tools_the_upstream_tests_call() {
    let Some((ok, text)) = run_in_image("agnhost", Some("WEFT_AGNHOST_IMAGE"), "/bin/bash", AGNHOST_TOOLS_SCRIPT)
    else {
        return;
    };
    assert!(ok && text.contains("all tools work"), "the agnhost image's tools:\n{text}");
    eprintln!("{text}");
}

/// The other images the sig-network tests run, each doing what the tests
/// have it do.
#[test]
fn the_other_test_images_run_what_the_tests_run_in_them() {
    let cases: [(&str, &str, &str); 4] = [
        // conntrack.go: `sh -c "while true; do sleep 2; nc boom-server 9000& done"`.
        (
            "busybox",
            "/bin/sh",
            "ip link set lo up; nc -l -p 9000 >/tmp/got & for i in $(seq 100); do echo hi | nc -w 1 127.0.0.1 9000 && break; sleep 0.1; done; wait; test \"$(cat /tmp/got)\" = hi && echo done",
        ),
        // kube_proxy.go: `which conntrack`, `conntrack -L -f ipv4 -d IP | grep ...`.
        (
            "distroless-iptables",
            "/bin/sh",
            "which conntrack && conntrack -L -f ipv4 && iptables --version && echo done",
        ),
        // endpoints.go: a plain server on port 80.
        (
            "nginx",
            "/bin/bash",
            "ip link set lo up 2>/dev/null || true; nginx -g 'daemon off;' & for i in $(seq 100); do exec 3<>/dev/tcp/127.0.0.1/80 && break; sleep 0.1; done; printf 'GET / HTTP/1.0\\r\\n\\r\\n' >&3; head -1 <&3 | grep -q '200 OK' && echo done",
        ),
        // conntrack.go: the server is the entrypoint.
        ("regression-issue-74839", "/bin/sh", "test -x /regression-issue-74839 && echo done"),
    ];
    for (name, shell, script) in cases {
        let Some((ok, text)) = run_in_image(name, None, shell, script) else { return };
        assert!(ok && text.contains("done"), "{name}:\n{text}");
    }
}
