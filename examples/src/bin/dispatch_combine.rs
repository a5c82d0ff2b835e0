//! The main job: expert-parallel dispatch and combine on every visible GPU.
fn main() -> anyhow::Result<()> {
    Ok(())
}
