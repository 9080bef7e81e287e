"""``unbroken`` command line: ``run`` (the finetune flow), ``check`` (a run looked at without running it:
control/check/), ``tune`` (the tune flow), ``stage`` (the staging flow), ``train`` (local mode: the training without
Ray or Prefect, ray_jobs/local.py), ``status`` and ``runs`` (the records), ``watchdog`` (the recovery flow, once or in
a loop), ``serve`` and ``server`` (the deployments, a local Prefect server), ``convert`` (another tool's config:
unbroken/convert.py). Its arguments are unbroken/arguments.py's; what it shows, unbroken/output.py's.
``UNBROKEN_STORAGE`` is the storage root of the commands that take ``--storage``.

The config is validated here first, so a bad config fails in a fraction of a second with every bad field named,
before Prefect, storage or a cluster is touched; ``run``, ``tune`` and ``stage`` then do ``check``'s checks
(control/check/). A user's mistake, at any stage, ends a command with its message alone and exit 2
(unbroken/errors.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, cast

from control.config import check_flow, load_config, validate
from ray_jobs.config.loading import RawTree, raw_config
from ray_jobs.secrets import export_credentials, mask, mask_logs
from unbroken import convert, errors, output
from unbroken.arguments import parser

if TYPE_CHECKING:  # the flows' summaries: the flows themselves are imported by the command that runs them
    from typing_extensions import TypeIs  # typing's own from Python 3.13

    from control.summaries import NothingNew, RunSummary, SearchSummary, TableRow


def nothing_new(s: RunSummary | NothingNew) -> TypeIs[NothingNew]:
    """A finetune flow's summary that says nothing was trained (the series trained this dataset already)."""
    return "nothing_new" in s


def _quiet_defaults() -> None:
    # The ephemeral Prefect server's telemetry write races its own startup (sqlite "database is locked").
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # Prefect gives its temporary server 20 s to answer; a local head starting beside it (``_with_early_cluster``)
    # takes both of a 2-core machine's cores for ~17 s, and `make demo` failed there on 2026-11-28 ("Timed out while
    # attempting to connect to ephemeral Prefect API server" after 21 s). The tests' conftest waits as long.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")


def _with_early_cluster(args: argparse.Namespace, run_flow: Callable[[], Coroutine[Any, Any, object]]) -> object:
    """Run a flow (``run_flow()``, a coroutine) while the cluster it will surely need starts coming up beside
    Prefect's temporary server; a head the flow never took over (it ended before it needed one) is released."""
    from flows.finetune import start_cluster_early

    early = start_cluster_early(args.cfg)
    try:
        # Prefect types a flow's call as its function's return (the summary, or a State carrying it: nothing new to
        # train), but the call resolves a returned State to its data (flow_engine's result): the summary either way
        return asyncio.run(run_flow())
    finally:
        if early is not None:
            early.release()


def cmd_run(args: argparse.Namespace) -> int:
    from flows.finetune import finetune

    # a run's summary, or the nothing-new one (a State's data, resolved by the call: see _with_early_cluster)
    s = cast("RunSummary | NothingNew", _with_early_cluster(args, lambda: finetune(args.config, args.overrides)))
    if nothing_new(s):
        print(s["message"])
        print(f"final model: {s['final_model']}")
        return 0
    print(f"run {s['run']}: {s['steps']} steps on dataset {s['dataset_id']}")
    print(f"eval loss: {s['first_eval_loss']:.4f} at step 0 -> {s['final_eval_loss']:.4f} at step {s['steps']}")
    print(f"held-out exact match: {s['exact_match']}")
    for x in s["samples"][:5]:
        print(f"  {x['prompt']!r}  (expected {x['target']!r})")
        print(f"    before: {x['before']!r}")
        print(f"    after:  {x['output']!r}")
    if verdict := s.get("verdict"):
        print(
            f"series {verdict['series']}: {'promoted' if verdict['promoted'] else 'not promoted'} -- {verdict['why']}"
        )
    print(f"final model: {s['final_model']}")
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from flows.tune import tune

    s = cast("SearchSummary", _with_early_cluster(args, lambda: tune(args.config, args.overrides)))  # a search searches
    print(f"search {s['run']}: {len(s['trials'])} trials on dataset {s['dataset_id']}")
    print(format_trials(s["trials"]))
    if verdict := s.get("verdict"):
        print(f"winner {s['winner']}: {'promoted' if verdict['promoted'] else 'not promoted'} -- {verdict['why']}")
    else:
        print("no trial completed: nothing to promote")
    print(f"final model: {s['final_model'] or '-'}")
    return 0


def format_trials(rows: list[TableRow]) -> str:
    """The trial table the CLI prints: each trial's values, state, steps, eval loss and series score."""
    fixed = ("trial", "state", "steps", "eval_loss", "score", "starts", "winner")
    params = [k for k in rows[0] if k not in fixed] if rows else []
    head = f"{'trial':<24} " + " ".join(f"{p:>18}" for p in params) + f" {'state':<14} {'steps':>6} {'eval loss':>9}"
    lines = [head]
    for r in rows:
        loss = "-" if r["eval_loss"] is None else f"{r['eval_loss']:.4f}"
        lines.append(
            f"{r['trial']:<24} "
            + " ".join(f"{r[p]!s:>18}" for p in params)
            + f" {r['state']:<14} {r['steps']:>6} {loss:>9}{'  <- winner' if r['winner'] else ''}"
        )
    return "\n".join(lines)


def cmd_check(args: argparse.Namespace) -> int:
    from control.check import check

    report = check(args.cfg, args.worker_memory)
    print(mask("\n".join(report.lines())))  # an address, a source or a model URL may carry a credential
    if report.problems:
        print(f"{len(report.problems)} problem(s): this run would not start", file=sys.stderr)
        return errors.USER_ERROR
    print("no problem found")
    return 0


def cmd_stage(args: argparse.Namespace) -> int:
    from flows.stage import stage_flow

    r = stage_flow(args.config, args.overrides)
    print(f"dataset id: {r['dataset_id']}{' (cache hit)' if r['cache_hit'] else ''}")
    print(f"manifest: {r['manifest_url']}")
    print(f"staged: {r['summary']}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """Local mode (ray_jobs/local.py): the run's training here, no Ray, no Prefect; rank 0 prints the final folder.
    Its only mode: ``--local`` is accepted and implied (under torchrun, whose own parser refuses a ``--local`` after
    the module as an ambiguous abbreviation of its --local-addr, it cannot be given at all)."""
    import logging

    from ray_jobs.local import train

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    final = train(args.cfg)
    if final is not None:
        print(f"final model: {final}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from control.describe import describe
    from control.series import lineage_lines
    from ray_jobs.config import absolute_url

    storage = absolute_url(args.storage)
    print("\n".join([describe(storage, args.run), *lineage_lines(storage, args.run)]))  # (RunNotFound: exit 2)
    return 0


def cmd_runs(args: argparse.Namespace) -> int:
    from control.series import format_table, table
    from ray_jobs.config import absolute_url

    print(format_table(table(absolute_url(args.storage), args.series)))
    return 0


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def cmd_watchdog(args: argparse.Namespace) -> int:
    """``--once``: one pass (one flow run). Otherwise a pass every ``--interval`` seconds until interrupted; a failed
    pass is reported and the loop goes on (the next pass retries whatever that one could not do)."""
    import signal
    import time

    from flows.watchdog import watchdog
    from ray_jobs.config import absolute_url

    storage = absolute_url(args.storage)
    signal.signal(signal.SIGTERM, _interrupt)  # a service manager's stop ends the loop like Ctrl-C
    if args.metrics_port is not None:
        from control.watchdog import metrics

        port = metrics.serve(args.metrics_port, args.metrics_host)
        print(f"watchdog metrics: http://{args.metrics_host}:{port}/metrics", flush=True)
    said: dict[str, str] = {}  # run -> its last line: a run left alone for the same reason is named once
    while True:
        started = time.monotonic()
        try:
            for o in watchdog(storage):
                line = f"{o['run']}: {o['action']} {o['detail']}".rstrip()
                if said.get(o["run"]) != line:
                    print(line, flush=True)
                said[o["run"]] = line
        except Exception as e:
            if args.once:
                raise
            print(f"watchdog pass failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        if args.once:
            return 0
        time.sleep(max(0.0, args.interval - (time.monotonic() - started)))


def cmd_serve(args: argparse.Namespace) -> int:
    if not os.environ.get("PREFECT_API_URL"):
        print(
            "error: PREFECT_API_URL is not set: schedules and triggers need a running Prefect server "
            "(start one with `unbroken server` or `make ui`, then export PREFECT_API_URL=http://127.0.0.1:4200/api)",
            file=sys.stderr,
        )
        return 2
    from deployments.serve import ServeOptions, serve

    load_config(args.config, [])  # a bad config fails now, not at 3 a.m.
    serve(
        ServeOptions(
            args.config,
            args.storage,
            args.cron,
            args.watchdog_interval,
            args.watch_source,
            args.sensor_interval,
            args.tune_config,
        )
    )
    return 0


def cmd_server(args: argparse.Namespace) -> int:
    """``prefect server start`` on 127.0.0.1 with its database under .unbroken/prefect (unless PREFECT_HOME is set);
    the UI's API URL is set to match the port."""
    home = os.environ.get("PREFECT_HOME") or os.path.abspath(".unbroken/prefect")
    api = f"http://127.0.0.1:{args.port}/api"
    env = dict(os.environ, PREFECT_HOME=home, PREFECT_API_URL=api, PREFECT_SERVER_ANALYTICS_ENABLED="false")
    print(f"Prefect UI: http://127.0.0.1:{args.port}   (clients: export PREFECT_API_URL={api})", flush=True)
    prefect = os.path.join(os.path.dirname(sys.executable), "prefect")
    os.execvpe(prefect, [prefect, "server", "start", "--host", "127.0.0.1", "--port", str(args.port)], env)


COMMANDS = {
    "run": cmd_run,
    "check": cmd_check,
    "tune": cmd_tune,
    "stage": cmd_stage,
    "train": cmd_train,
    "watchdog": cmd_watchdog,
    "serve": cmd_serve,
    "convert": convert.cmd_convert,
}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    debug = errors.debugging(args.debug)
    _quiet_defaults()  # before anything imports Prefect: its settings are read once, at its import
    args.verbose = output.verbose(args.verbose)
    if not args.verbose:
        output.quiet_env()
    mask_logs()  # what this process logs (and Prefect stores of its flow runs) never shows a credential
    if getattr(args, "overrides", None):  # a flow run's parameters are stored and shown: masked, the real URIs kept
        args.overrides = export_credentials(args.overrides)  # in this process's UNBROKEN_CREDENTIALS (revealed on load)
    try:
        return _dispatch(args, debug)
    except BaseException as e:  # noqa: BLE001 -- the command's last word, whatever ended it (unbroken/errors.py)
        if isinstance(e, SystemExit):
            raise
        return errors.report(e, debug)


def _dispatch(args: argparse.Namespace, debug: bool) -> int:
    if args.command in ("server", "status", "runs"):
        return {"server": cmd_server, "status": cmd_status, "runs": cmd_runs}[args.command](args)
    relative: list[tuple[str, str]] = []
    try:
        if args.command in ("run", "tune", "stage", "train", "check"):
            raw = raw_config(args.config, args.overrides)
            relative = output.relative_paths(raw)
            _load(args, raw)
        if not debug and args.command in ("run", "tune", "stage", "watchdog", "serve"):
            errors.hide_user_errors()
        if not args.verbose and args.command in ("run", "tune", "stage"):
            output.quiet_console()
        return COMMANDS[args.command](args)
    except Exception as e:
        output.note_missing(e, relative)  # a path the config gave relative: where it was looked for
        raise


def _load(args: argparse.Namespace, raw: RawTree) -> None:
    """The config, loaded once before Prefect is imported (the commands take it from here; a flow loads its own
    again from the path and overrides, its parameters: what a flow run started from the UI or a deployment has),
    and ``check``'s checks for the commands that run."""
    cfg = args.cfg = validate(raw, str(args.config))
    if args.command in ("run", "tune"):
        check_flow(cfg, search=args.command == "tune", source=args.config)
        from control.cluster import preflight

        preflight(cfg)  # a head on the run's ports it must not use: one line, before Prefect
    if args.command in ("run", "tune", "stage"):
        from control.check import refuse_early

        for w in refuse_early(cfg, with_cluster=args.command != "stage"):  # `check`'s checks, before Prefect
            print(mask(f"warning: {w.area}: {w.text}"), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
