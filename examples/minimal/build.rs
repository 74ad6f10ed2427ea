// Re-embed the migrations whenever one changes (sqlx::migrate! reads them at compile time).
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
