// sqlx::migrate! embeds migrations/ when the crate compiles: a migration
// added without a change to the Rust code must still rebuild it.
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
