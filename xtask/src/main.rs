//! Project automation.
fn main() -> anyhow::Result<()> {
    Ok(())
}
