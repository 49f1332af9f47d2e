//! Writes one YAML file per Weft CRD into the given directory (default `crds/`).

use std::path::PathBuf;

use anyhow::Context;

fn main() -> anyhow::Result<()> {
    let dir = PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| "crds".into()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    for crd in weft_api::crds() {
        let path = dir.join(weft_api::crd_file_name(&crd));
        let yaml = weft_api::crd_yaml(&crd).context("serialising CRD")?;
        std::fs::write(&path, yaml).with_context(|| format!("writing {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
