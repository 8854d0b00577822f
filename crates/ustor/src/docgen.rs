//! `ustor completions SHELL` and the hidden `ustor manpages DIR`: shell
//! completion scripts and man pages generated from the clap command tree, so
//! what the Debian package ships never drifts from the real flags.

use std::path::PathBuf;

use clap::CommandFactory;

#[derive(clap::Args)]
pub struct CompletionsArgs {
    /// bash, zsh, fish, elvish or powershell.
    #[arg(value_enum)]
    shell: clap_complete::Shell,
}

#[derive(clap::Args)]
pub struct ManpagesArgs {
    /// Directory to write ustor.1 and one ustor-SUBCOMMAND.1 per subcommand to.
    dir: PathBuf,
}

/// Prints the completion script to stdout (`ustor completions bash >
/// /usr/share/bash-completion/completions/ustor`).
pub fn completions(a: CompletionsArgs) -> i32 {
    let mut cmd = crate::Cli::command();
    let mut buf = Vec::new();
    clap_complete::generate(a.shell, &mut cmd, "ustor", &mut buf);
    crate::write_stdout(&buf)
}

pub fn manpages(a: ManpagesArgs) -> i32 {
    let r = std::fs::create_dir_all(&a.dir)
        .and_then(|()| clap_mangen::generate_to(crate::Cli::command(), &a.dir));
    match r {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("ustor manpages: {}: {e}", a.dir.display());
            1
        }
    }
}
