fn main() -> std::process::ExitCode {
    idpool::cli::run()
}
