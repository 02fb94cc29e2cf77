"""``k3serve sim``: replay a trace at N clusters in simulated time with the project's routing and cache code."""

from __future__ import annotations

import typer

from k3serve.cli.output import emit

app = typer.Typer(invoke_without_command=True)  # `k3serve sim --trace FILE ...`: the group's callback is the command


def _list(text: str, kind: type, flag: str) -> tuple:
    try:
        return tuple(kind(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter(f"{flag} must be a comma-separated list of {kind.__name__}s, got {text!r}")


@app.callback()
def sim(trace: str = typer.Option(..., "--trace", help="a trace in Mooncake's format (JSON lines)"),
        clusters: str = typer.Option("8", "--clusters", help="fleet sizes, e.g. 8,100,1000"),
        policy: str = typer.Option("", "--policy",
                                   help="anonymous routing policies side by side (first-block,prefix-load,random); "
                                        "default: the deployment's own (--config), else prefix-load"),
        cache: str = typer.Option("1", "--cache", help="fleet cache capacity as fractions of the working set"),
        config: str = typer.Option("", "--config", help="a deploy file: its routing policy, prefix-cache policy "
                                                        "and (with --pool-from-config) its prefill pools"),
        pool_from_config: bool = typer.Option(False, "--pool-from-config",
                                              help="each cluster's pools are the deploy file's prefill pools"),
        slot_blocks: int = typer.Option(8, "--slot-blocks", help="cache blocks per KDA checkpoint slot"),
        rate_scale: float = typer.Option(1.0, "--rate-scale", help="arrivals sped up this many times"),
        max_requests: int = typer.Option(0, "--max-requests", min=0),
        max_blocks: int = typer.Option(0, "--max-blocks", min=0, help="cut prompts to this many 512-token blocks"),
        system_blocks: int = typer.Option(0, "--system-blocks", min=0,
                                          help="prefix every request with this many shared blocks (a system prompt)"),
        cost: str = typer.Option("k3-8gpu", "--cost", help="a preset or a `k3serve bench trace --json` file"),
        prefill_tps: float = typer.Option(None, "--prefill-tps", help="override the cost model's prefill rate"),
        slo_s: float = typer.Option(2.0, "--slo-s", help="TTFT SLO in seconds"),
        kill_at: float = typer.Option(None, "--kill-at", help="cluster c0 dies at this simulated second"),
        fleet_search: bool = typer.Option(False, "--fleet-search",
                                          help="also find the fleet size each policy needs for 99% under the SLO"),
        as_json: bool = typer.Option(False, "--json")) -> None:
    """Replay the trace at each fleet size and cache size, every policy in one run; prints `runs` (JSON with --json)."""
    from k3serve.sim.cost import model_named, with_rate
    from k3serve.sim.runs import SimPlan, run_plan
    from k3serve.sim.trace import BLOCK, TraceError, load_trace, with_system_prompt

    try:
        policies = _list(policy, str, "--policy")
        plan_kw = {}
        if config:
            from k3serve.cluster.deploy import load_deploy

            d = load_deploy(config)
            policies = policies or (d.control.anonymous_routing,)
            plan_kw["policy"] = d.clusters.prefix_policy()
            if pool_from_config:
                pools = d.clusters.prefill_pools
                plan_kw["pages"] = pools.mla_pages * pools.page_size // BLOCK
                plan_kw["slots"] = pools.kda_slots
        plan = SimPlan(_list(clusters, int, "--clusters"), policies or ("prefix-load",), _list(cache, float, "--cache"),
                       slot_blocks=slot_blocks, rate_scale=rate_scale, slo_s=slo_s, kill_at_s=kill_at,
                       fleet_search=fleet_search, **plan_kw)
        model = with_rate(model_named(cost), prefill_tps)
        reqs = with_system_prompt(load_trace(trace, max_requests, max_blocks), system_blocks)
        result = run_plan(reqs, plan, model)
    except (TraceError, ValueError, OSError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    if not as_json:
        result = {k: v for k, v in result.items() if k != "runs"} | {
            f"run {i}": {k: r[k] for k in ("policy", "clusters", "cache_fraction", "reuse", "ideal_reuse",
                                           "load_max_over_mean", "ttft_p99_s", "slo_attainment")}
            for i, r in enumerate(result["runs"])}
    emit(result, as_json)
