//! `dreamddp`: the command-line entry point. Subcommands live in their own modules.

mod allocator;
mod bench_cmd;
mod bench_tch;
mod cli;
mod cluster_cmd;
mod cluster_file;
mod cluster_health;
mod cluster_summary;
mod compare;
mod coordinator_cmd;
mod fidelity_cmd;
mod fidelity_pace;
mod fidelity_past_cutoff;
mod fidelity_print;
mod fidelity_reuse;
mod fidelity_seeds;
mod global_model;
mod link_check;
mod nccl_check;
mod node_cmds;
mod plots;
mod real_timeline;
mod scenario_cluster;
mod simulate_cmd;
mod status_probe;
mod train_cmd;

use clap::Parser;

fn main() {
    let args = cli::Cli::parse();
    if matches!(
        args.command,
        cli::Command::Coordinator(_)
            | cli::Command::Aggregator(_)
            | cli::Command::Worker(_)
            | cli::Command::Edge(_)
            | cli::Command::Swarm(_)
    ) {
        allocator::tune_for_a_long_running_node();
    }
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new(if args.verbose { "debug" } else { "info" })
    });
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        // Colours only on a terminal: the cluster's children log into files.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
    let result = match args.command {
        cli::Command::Train(a) => train_cmd::run(*a),
        cli::Command::Plan(a) => train_cmd::plan(*a),
        cli::Command::Bench(a) => bench_cmd::run(a),
        cli::Command::Simulate(a) => simulate_cmd::run(*a),
        cli::Command::Coordinator(a) => coordinator_cmd::run(a),
        cli::Command::Cluster(a) => cluster_cmd::run(a),
        cli::Command::Fidelity(a) => fidelity_cmd::run(a),
        cli::Command::Aggregator(a) => node_cmds::aggregator(a),
        cli::Command::Worker(a) => node_cmds::trainer(a, protocol::Role::Worker),
        cli::Command::Edge(a) => node_cmds::trainer(a, protocol::Role::Edge),
        cli::Command::Swarm(a) => node_cmds::swarm(a),
        cli::Command::Certs(a) => node_cmds::certs(a),
        cli::Command::Relay(a) => node_cmds::relay(a),
        cli::Command::NcclCheck(a) => nccl_check::run(a),
        cli::Command::LinkCheck(a) => link_check::run(&a),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
