//! Shared by the build scripts of `ep-kernels` and `ibgda-emu`: embeds the fatbins that
//! `cargo xtask build-kernels` wrote and listed in a `manifest.txt` (one `name\tpath` a line) as a
//! generated `MODULES: &[(&str, &[u8])]`. With no manifest the table is empty and the crate still
//! compiles. Included with `#[path]`, so a build script needs no extra crate.

use std::fmt::Write as _;
use std::path::PathBuf;

/// What differs between the crates that embed fatbins.
pub struct Embed<'a> {
    /// Environment variable that names the kernels folder outright.
    pub dir_env: &'a str,
    /// The kernels folder below the target folder (`kernels`, `kernels/emu`).
    pub target_subdir: &'a str,
    /// The rustdoc line and visibility of the generated table, e.g. `pub(crate)`.
    pub doc: &'a str,
    pub visibility: &'a str,
    /// What a module is called in the warning for a listed but missing fatbin.
    pub what: &'a str,
    /// The generated file's name in `OUT_DIR`.
    pub out_file: &'a str,
}

impl Embed<'_> {
    /// Writes the table into `OUT_DIR` and prints the `rerun-if` lines.
    pub fn run(&self) {
        let manifest_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap());
        let root = manifest_dir
            .parent()
            .and_then(|p| p.parent())
            .expect("the crate is two levels below the workspace root")
            .to_path_buf();
        let kernels = match std::env::var_os(self.dir_env) {
            Some(d) => PathBuf::from(d),
            None => match std::env::var_os("CARGO_TARGET_DIR") {
                Some(t) if PathBuf::from(&t).is_absolute() => {
                    PathBuf::from(t).join(self.target_subdir)
                }
                Some(t) => root.join(t).join(self.target_subdir),
                None => root.join("target").join(self.target_subdir),
            },
        };
        println!("cargo:rerun-if-env-changed={}", self.dir_env);
        println!("cargo:rerun-if-env-changed=CARGO_TARGET_DIR");
        let manifest = kernels.join("manifest.txt");
        println!("cargo:rerun-if-changed={}", manifest.display());

        let mut code = format!(
            "/// {}\n{} static MODULES: &[(&str, &[u8])] = &[\n",
            self.doc, self.visibility
        );
        if let Ok(text) = std::fs::read_to_string(&manifest) {
            for line in text.lines() {
                let Some((name, path)) = line.split_once('\t') else {
                    continue;
                };
                println!("cargo:rerun-if-changed={path}");
                if std::path::Path::new(path).is_file() {
                    writeln!(code, "    ({name:?}, include_bytes!({path:?})),").unwrap();
                } else {
                    println!(
                        "cargo:warning={} {name} listed but {path} is missing: run `cargo xtask build-kernels`",
                        self.what
                    );
                }
            }
        }
        code.push_str("];\n");
        let out = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join(self.out_file);
        std::fs::write(out, code).unwrap();
    }
}
