//! `cargo run -p pulsar-gguf --example inspect FILE`: the inspect report,
//! until the host CLI wires it.
fn main() {
    let Some(path) = std::env::args_os().nth(1) else {
        eprintln!("usage: inspect FILE.gguf");
        std::process::exit(2);
    };
    match pulsar_gguf::GgufFile::open(&path) {
        Ok(f) => print!("{}", pulsar_gguf::report::report(&f)),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
