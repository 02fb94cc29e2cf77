"""``k3serve drill``: start a deployment, run a multi-turn workload, inject a fault, report (JSON)."""

from __future__ import annotations

import typer

from k3serve.cli.output import emit, results_only_stdout

app = typer.Typer(help="Failover drill through the router with a fault injected mid-run.",
                  invoke_without_command=True, no_args_is_help=False)


@app.callback()
def drill(config: str = typer.Option("configs/local.yaml", "--config"),
          kill: str = typer.Option("cluster:c0", "--kill", help="cluster:ID | decode:ID | prefill:ID | node:N | router | redis | none "
                                 "(node:N: a custom resource only that node has, or its node id)"),
          at_s: float = typer.Option(3.0, "--at"),
          sessions: int = typer.Option(24, "--sessions"),
          turns: int = typer.Option(3, "--turns"),
          max_tokens: int = typer.Option(24, "--max-tokens"),
          seed: int = typer.Option(-1, "--seed", help="Workload seed (sessions and prompts); -1: a fresh one."),
          after_turns: int = typer.Option(0, "--after-turns",
                                          help="Inject the fault no earlier than every session completed this many turns."),
          samples: bool = typer.Option(True, "--samples/--no-samples",
                                       help="Also generate a few code prompts, greedy and sampled (report key 'samples', text on stderr)."),
          as_json: bool = typer.Option(False, "--json")) -> None:
    from k3serve.cluster.deploy import DeployError, load_deploy
    from k3serve.cluster.deployment import Deployment
    from k3serve.cluster.drill import Fault, run_drill

    try:
        deploy = load_deploy(config)
        fault = None if kill == "none" else Fault.parse(kill)
        if fault is not None and fault.kind != "node" and fault.target and \
                fault.target not in deploy.clusters.cluster_ids:
            raise ValueError(f"--kill {kill}: no cluster {fault.target!r} in {list(deploy.clusters.cluster_ids)}")
        if fault is not None and fault.kind == "router" and deploy.routers < 2:
            raise ValueError("--kill router needs at least 2 routers in the deploy file")
    except (DeployError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    with results_only_stdout() as out, Deployment(deploy) as dep:
        typer.echo(f"drill: deployment up, routers {dep.router_addresses}; running {sessions} sessions x {turns} turns,"
                   f" fault {kill} at {at_s}s", err=True)
        result = run_drill(dep, fault, at_s, sessions, turns, max_tokens, seed=None if seed < 0 else seed,
                           after_turns=after_turns, check=False)
        if samples:
            from k3serve.cluster.samples import sample_texts

            result["samples"] = sample_texts(dep.router_addresses[-1], dep.checkpoint)
            for s in result["samples"]:  # readable next to the JSON report, which stays alone on stdout
                typer.echo(f"--- sample, {s['mode']} ({'= reference' if s['matches_reference'] else 'DIFFERS from reference'})"
                           f"\n{s['prompt']}{s['text']}", err=True)
    emit(result, as_json, out)
    ok = not result["violations"]
    raise typer.Exit(0 if ok else 1)
