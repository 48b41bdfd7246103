//! The `ipreclaim` binary (also `kubectl-ipreclaim`, the kubectl plugin): see [`cli`].

mod cli;

fn main() -> std::process::ExitCode {
    cli::main()
}
