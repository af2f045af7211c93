fn main() -> std::process::ExitCode {
    idpool::edge::cli::run()
}
