"""Sweeps of `smd train` runs, shared by `smd ablate` and `smd reproduce`: the members a sweep asks for,
what names them, and running them through Hydra's launcher.

A sweep is a list of `KEY=v1,v2` entries (a recipe's `ablate.sweep`) with the command line's on top. Its
members are the combinations of the values; each member's train config is composed up front (a mistake
names the member), and a member is named by what it runs, `TASK_ALGO[_EVICTION_cC][_lamL]_seedS_HASH`,
with HASH a SHA-256 of its composed config (less the keys that only change how a run is carried out), so
that the same run asked for twice is one directory. Members are launched by `hydra/launcher` (`basic`: one
after another, streamed to this terminal; `joblib`: in parallel local processes; `submitit_slurm`: SLURM
jobs); each is a `smd train` process in its own directory (`resume=true`: an interrupted member continues
from its last checkpoint), its output kept in `console.log` and its outcome in `member.json`. A member
that fails is an outcome, never an exception: the others go on. The launcher's task locks the member's
directory before it writes anything there and hands the lock down to its `smd train`: two sweeps sharing a
runs directory run a shared member once (the second waits, saying for whom, then reuses the result).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.markup import escape

from smd_cli.config.rules import check_config
from smd_cli.config.validation import ROOT, ConfigError, one_line
from smd_cli.evaluation.heldout import LEGACY
from smd_cli.rollout import adaptive
from smd_cli.runtime import integrity, lifetime, records
from smd_cli.runtime.records import write_json

OUTPUT_TAIL = 1 << 20  # bytes of a member's output kept in memory for its reason
INTERRUPT_GRACE = 30.0  # seconds a member interrupted by Ctrl-C has to write its summary and say where it stopped
SWEEP_PID = "SMD_SWEEP_PID"
REASON_CHARS = 300
# keys that change how a run is carried out, not what it computes: left out of a member's identity
NOT_IDENTITY = ("progress", "threads", "cache_dir", "resume", "checkpoint", "log_every", "stage_help", "ablate", "run_dir", "overrides", "hydra")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_ERROR_HEAD = re.compile(r"^(config error:|training diverged:|disk full:|error:|[A-Za-z_][\w.]*(Error|Exception|Interrupt|Diverged)\b)")


@dataclass
class Member:
    """One run of the sweep: its swept values, its train overrides, and where it runs."""

    combo: tuple[tuple[str, str], ...]  # ((key, value), ...) in the sweep's order
    overrides: list[str]  # the `smd train` overrides: the fixed ones, then the swept values
    identity: str  # SHA-256 of the composed config, less NOT_IDENTITY
    name: str  # directory name in the runs directory
    before: tuple = ()  # what its held-out evaluations before training depend on (members alike share them: eval.reuse_before)
    twin: tuple[str, str] | None = None  # (identity, name) of the same run with eval.prompts=fixed, for a per-seed member

    @property
    def label(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.combo)


def parse_sweep(specs) -> list[tuple[str, list[str]]]:
    """["lambda=0.1,0.8", "algo=smd,tis"] -> [("lambda", ["0.1", "0.8"]), ("algo", ["smd", "tis"])]."""
    sweep = []
    for spec in specs:
        key, sep, values = str(spec).partition("=")
        options = [v.strip() for v in values.split(",") if v.strip()]
        if not sep or not key.strip() or not options:
            raise ConfigError(f"ablate sweep entry {spec!r} is not allowed: write KEY=v1,v2,...")
        sweep.append((key.strip(), options))
    return sweep


def sweep_of(cfg: DictConfig, fixed: list[str]) -> list[tuple[str, list[str]]]:
    """`ablate.sweep` with `ablate.command_line` on top (same key: replaced), then fixed by the command line's
    plain `KEY=v` for a swept key (it becomes that one value), then cut to `ablate.subset`'s values of a swept
    key (keys the sweep does not have are ignored)."""
    sweep = dict(parse_sweep(cfg.ablate.sweep))
    sweep.update(parse_sweep(cfg.ablate.command_line))
    for override in fixed:
        key, _, value = override.partition("=")
        if key in sweep:
            sweep[key] = [value]
    for key, keep in parse_sweep(cfg.ablate.get("subset") or []):  # e.g. a quick check: fewer values of a swept key
        if key in sweep:
            kept = [v for v in sweep[key] if any(_same(v, k) for k in keep)]
            if not kept:  # never a silent fallback to every value
                raise ConfigError(f"ablate.subset entry '{key}={','.join(keep)}' is not allowed: none of its values is among "
                                  f"the swept values of {key} ({', '.join(sweep[key])}); keep a subset of those")
            unknown = [v for v in keep if not any(_same(v, s) for s in sweep[key])]
            if unknown:  # a subset shared by several sweeps (make reproduce QUICK=1) names values some do not sweep
                Console(stderr=True).print(f"note: ablate.subset {key}={','.join(unknown)}: not swept here "
                                           f"({', '.join(sweep[key])}), left out", markup=False, highlight=False)
            sweep[key] = kept
    if not sweep:
        raise ConfigError("ablate.sweep=[] is not allowed: give at least one KEY=v1,v2 (e.g. `smd ablate lambda=0.1,0.8`) "
                          "or a recipe that sweeps (`smd ablate +recipe=ablate_lambda`)")
    return list(sweep.items())


def _same(a: str, b: str) -> bool:
    """Two written values of a key are the same value: equal text, or equal numbers (0.1 and 0.10)."""
    if a == b:
        return True
    try:
        return float(a) == float(b)
    except ValueError:
        return False


def user_overrides(cfg: DictConfig) -> list[str]:
    """The command line's overrides other than the sweep itself (passed on to every train run)."""
    given = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else list(cfg.get("overrides") or [])
    return [o for o in given if not o.startswith(("ablate.", "run_dir=", "+run_dir=", "overrides=", "+overrides="))]


def plan(cfg: DictConfig, base: list[str]) -> tuple[list[tuple[str, list[str]]], list[Member]]:
    """The sweep of an ablate config `cfg` given with the command line's fixed overrides `base`, and its members,
    one per combination of the swept values, every one's train config composed (a mistake is a ConfigError
    naming the member) and named."""
    sweep = dict(sweep_of(cfg, base))
    fixed = [o for o in base if o.partition("=")[0] not in sweep]
    combos = itertools.product(*[[(key, v) for v in values] for key, values in sweep.items()])
    with _compose_context():
        composer = _Composer(fixed, sweep)
        members = [_member(combo, [*fixed, *(f"{k}={v}" for k, v in combo)], composer) for combo in combos]
    return list(sweep.items()), members


def stand_ins(members: list[Member], runs_dir: Path) -> tuple[list[Member], list[str]]:
    """Each member whose own run in `runs_dir` is not finished but whose fixed-prompts twin's is (`Member.twin`: the
    same run with eval.prompts=fixed, as every run recorded before that key was): the twin in its place. Its held-out
    numbers are about the fixed prompts (the report reads each run's config.json and says so). Returns the members,
    twins in place, and the twins' directory names."""
    chosen: dict[str, bool] = {}
    out, used = [], []
    for m in members:
        if m.twin is not None and m.identity not in chosen:
            identity, name = m.twin
            chosen[m.identity] = not finished(runs_dir / m.name, m) and _finished(runs_dir / name, identity) is not None
            if chosen[m.identity]:
                used.append(name)
        out.append(replace(m, identity=m.twin[0], name=m.twin[1], twin=None) if chosen.get(m.identity) else m)
    return out, used


def distinct(members: list[Member]) -> list[Member]:
    """One member per run: combinations that compose to the same config (`lambda=0.1` and `0.10`, or any lambda
    of a non-SMD run) share it."""
    first: dict[str, Member] = {}
    for m in members:
        first.setdefault(m.identity, m)
    return list(first.values())


class _Composer:
    """The train config of each combination of a sweep, composed as Hydra composes it, once per combination of the
    swept config groups (algo, eviction, task, ...): Hydra composes the defaults of the groups, then sets each plain
    `KEY=value` override on the result (`ConfigLoaderImpl._apply_overrides_to_config`), which is what is done here to
    a copy of the composed groups for the swept values (seed, lambda, compression, ...). A sweep over 8 seeds composes
    once instead of 8 times (~0.1 s each)."""

    def __init__(self, fixed: list[str], sweep: dict[str, list[str]]):
        from hydra.core.global_hydra import GlobalHydra

        repository = GlobalHydra.instance().config_loader().repository
        self.fixed, self.cache = fixed, {}
        self.values = {k for k in sweep if re.fullmatch(r"[A-Za-z_][\w.]*", k) and not repository.group_exists(k)}

    def __call__(self, combo: tuple) -> DictConfig:
        from hydra import compose
        from hydra._internal.config_loader_impl import ConfigLoaderImpl
        from hydra.core.override_parser.overrides_parser import OverridesParser

        groups = tuple(f"{k}={v}" for k, v in combo if k not in self.values)
        if groups not in self.cache:
            self.cache[groups] = compose(config_name="train", overrides=[*self.fixed, *groups], return_hydra_config=True)
        cfg = copy.deepcopy(self.cache[groups])
        values = OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in combo if k in self.values])
        ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
        return cfg


def _member(combo: tuple, overrides: list[str], composer: _Composer) -> Member:
    label = ",".join(f"{k}={v}" for k, v in combo)
    try:
        cfg = composer(combo)
    except Exception as err:  # Hydra's override and composition errors
        raise ConfigError(f"ablate run {label}: {one_line(err)}") from None
    try:  # every value of the member, by the rules `smd train` applies (a swept `lambda=abc` is named here)
        check_config(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), "train")
    except ConfigError as err:
        raise ConfigError(f"ablate run {label}: {err}") from None
    if adaptive.problem(cfg):  # what depends on several keys, as `smd train` checks it (compression=adaptive with algo=dense)
        raise ConfigError(f"ablate run {label}: {adaptive.problem(cfg)}")
    choices, identity = cfg.hydra.runtime.choices, config_identity(cfg)
    twin = config_identity(cfg, prompts=LEGACY) if cfg.eval.get("prompts", LEGACY) != LEGACY else None
    config = {k: OmegaConf.to_container(cfg[k], resolve=True) if OmegaConf.is_config(cfg[k]) else cfg[k]
              for k in ("algo", "compression", "lambda", "seed")}
    parts = [choices.task, config["algo"]["name"]]
    if config["algo"]["evicting"]:
        c = config["compression"]
        parts += [choices.eviction, f"c{c}" if isinstance(c, str) else f"c{c:g}"]  # c0.5, or cadaptive
    if config["algo"].get("distill"):  # lambda is read only by an algorithm that distils (SMD)
        parts.append(f"lam{config['lambda']:g}")
    parts.append(f"seed{config['seed']}")
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", "_".join(map(str, parts)))
    return Member(tuple(combo), overrides, identity, f"{stem}_{identity[:8]}", before_evaluation(cfg, choices),
                  None if twin is None else (twin, f"{stem}_{twin[:8]}"))


def before_evaluation(cfg: DictConfig, choices) -> tuple:
    """What a member's evaluations before training depend on, as far as its config tells (the cost model's share of
    `smd_cli.evaluation.cache`): the task, the starting weights (a seed's own warm start), the evaluating eviction and
    compression, the prompts; the seed also when the evaluation samples or its prompts are the seed's own."""
    warm = cfg.model.get("warmstart") or {}
    seeded = bool(warm.get("steps")) or cfg.eval.temperature > 0 or cfg.eval.get("prompts", LEGACY) != LEGACY
    evicting = f"{choices.eviction}" if cfg.algo.evicting else f"dense:{cfg.eval.dense_eviction}"
    return (choices.task, choices.model, f"seed={cfg.seed}" if seeded else "", evicting, str(cfg.compression), int(cfg.eval.num_prompts))


def config_identity(cfg: DictConfig, prompts: str | None = None) -> str:
    """SHA-256 of a composed train config, less the keys that only change how it is carried out (NOT_IDENTITY)
    and `lambda` for the algorithms that do not read it (all but those that distil: SMD). `eval.prompts` at its
    legacy value `fixed` is left out too: a run recorded before the key existed evaluated the fixed prompts, and keeps
    its identity (and directory) as the run of `eval.prompts=fixed`. `model.cpu_dtype=auto` is the dtype this machine
    computes in (`_resolve_cpu_dtype`). `prompts`: the identity with that draw instead
    (a per-seed member's fixed-prompts twin, `Member.twin`)."""
    unused = NOT_IDENTITY + (() if cfg.algo.get("distill") else ("lambda",))
    config = {k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v for k, v in cfg.items() if k not in unused}
    _resolve_cpu_dtype(config)
    held = config.get("eval")
    if isinstance(held, dict) and "prompts" in held:
        draw = prompts or held["prompts"]
        held.pop("prompts")
        if draw != LEGACY:
            held["prompts"] = draw
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()


def _resolve_cpu_dtype(config: dict) -> None:
    """`model.cpu_dtype=auto` as what this machine computes in, where that is not `model.dtype` (a CPU with native
    bf16): a run in bfloat16 is not the run in float32 that `auto` names on a CPU without it, and a sweep continued on
    another machine must not pair the two. Where `auto` resolves to `model.dtype` it stays `auto` (the identity runs
    recorded before this rule have), and a run that goes to a GPU computes in `model.dtype` whatever the CPU has."""
    model = config.get("model")
    if not isinstance(model, dict) or model.get("cpu_dtype") != "auto":
        return
    import torch  # here, not above: a sweep of configs without `auto` plans without torch

    from smd_cli.model.precision import cpu_compute_dtype

    if config.get("device") == "cuda" or (config.get("device") == "auto" and torch.cuda.is_available()):
        return
    resolved = cpu_compute_dtype("auto", model.get("dtype"))
    if resolved != model.get("dtype"):
        model["cpu_dtype"] = resolved


def _compose_context():
    """Compose with the running CLI's search path and recipes, or (a direct call, tests) with conf/ alone."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        return contextlib.nullcontext()
    return initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3")


OUTCOMES = {"completed": "ok", "collapsed": "collapsed"}  # a train run's summary status -> the member's outcome (else failed)


def finished(run_dir: Path, member: Member) -> bool:
    """Whether `run_dir` holds this member's finished run (its outcome recorded, its summary complete): completed,
    or collapsed (a result too: run again, it would collapse again)."""
    return _finished(run_dir, member.identity) is not None


def _finished(run_dir: Path, identity: str) -> dict | None:
    """The `member.json` of the finished run of the member `identity` in `run_dir`, else None."""
    record, _ = read_json(run_dir / "member.json")
    summary, _ = read_json(run_dir / "summary.json", summary=True)
    done = (record.get("identity") == identity and record.get("status") in OUTCOMES.values()
            and OUTCOMES.get(summary.get("status")) == record.get("status"))
    return record if done else None


def member_command(overrides: list[str], run_dir: Path) -> list[str]:
    """The `smd train` command line of one member (resuming its own directory if it was interrupted)."""
    return [sys.executable, "-m", "smd_cli.cli", "train", *overrides, f"hydra.run.dir={run_dir}", "resume=true"]


def run_member(cfg: DictConfig) -> dict:
    """The launcher's task: run one member as a `smd train` process in its directory (the job's output dir) and
    record its outcome in `member.json`. Never raises: a failure is an outcome. The directory is locked first
    (another sweep running this member: wait for it, then reuse its result), before anything is written."""
    sweep = os.environ.get(SWEEP_PID)
    if sweep and sweep.isdigit() and int(sweep) != os.getpid():  # a launcher's worker process (joblib): die with the sweep
        lifetime.watch_parent(int(sweep))
    job = HydraConfig.get()
    run_dir = Path(job.runtime.output_dir)
    overrides, identity = list(job.overrides.task), config_identity(cfg)
    stream = str(job.launcher.get("_target_", "")).endswith("BasicLauncher")  # one at a time: show it as it runs
    started = time.time()
    try:
        integrity.hold(run_dir, "smd ablate member", wait=True, say=lambda text: print(f"ablate: {run_dir.name}: {text}", flush=True))
    except (integrity.Unwritable, OSError) as err:  # nothing can be written there, member.json included
        return {"identity": identity, "overrides": overrides, "status": "failed", "returncode": None, "error": str(err)}
    try:
        again = _finished(run_dir, identity)
        if again is not None:  # run to the end by the sweep this one waited for
            print(f"ablate: {run_dir.name}: finished by another sweep meanwhile; its result is reused", flush=True)
            return again
        return _run_locked(run_dir, overrides, identity, stream, started)
    finally:
        integrity.release(run_dir)


def _run_locked(run_dir: Path, overrides: list[str], identity: str, stream: bool, started: float) -> dict:
    """`run_member`'s work once it holds the member's directory."""
    (run_dir / "summary.json").unlink(missing_ok=True)  # a previous attempt's result is not this run's
    command = member_command(overrides, run_dir)
    try:
        returncode, output = run_logged(command, run_dir / "console.log", stream, locked=run_dir)
    except integrity.Unwritable as err:  # e.g. console.log is a link: nothing is run, nothing written through it
        returncode, output = 126, f"error: {err}"
    except OSError as err:
        returncode, output = 127, f"error: could not start {command[0]}: {err}"
    summary, unreadable = read_json(run_dir / "summary.json", summary=True)
    outcome = None if unreadable else OUTCOMES.get(summary.get("status"))  # collapsed: exit 1, but a finished result
    if outcome == "ok" and returncode != 0:
        outcome = None
    error = None if outcome else unreadable or failure_reason(returncode, output, summary)
    record = {"identity": identity, "overrides": overrides, "status": outcome or "failed", "returncode": returncode,
              "error": error, "run_status": summary.get("status"), "status_reason": summary.get("status_reason"),
              "seconds": round(time.time() - started, 1), "command": command}
    try:
        write_json(run_dir / "member.json", record)
    except integrity.Unwritable as err:  # member.json a link: the outcome is said here, and the member counts as failed
        record.update(status="failed", error=str(err))
    if not stream:
        said = {"ok": "ok", "collapsed": f"collapsed: {record['status_reason']}"}.get(record["status"], f"failed: {error}")
        print(f"ablate: {run_dir.name}: {said} ({record['seconds']:.0f} s)", flush=True)
    return record


def run_logged(command: list[str], log: Path, stream: bool, locked: Path | None = None) -> tuple[int, str]:
    """Run `command` with its stdout and stderr both written to `log` as they come (and to ours when `stream`);
    (exit status, the last OUTPUT_TAIL bytes of its stderr, where its error is). `locked`: a directory this
    process holds (`integrity.hold`), whose lock the command inherits."""
    import selectors

    integrity.make_dir(log.parent, "a run's console.log")
    env, fds = integrity.handed_down(locked) if locked is not None else ({}, ())
    tail = bytearray()
    with integrity.open_new(log, "a run's console.log") as sink:  # never through a link
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=lifetime.child_env({**os.environ, **env}),
                                pass_fds=fds)
        ours = {proc.stdout: sys.stdout, proc.stderr: sys.stderr}
        selector = selectors.DefaultSelector()
        for pipe in ours:
            selector.register(pipe, selectors.EVENT_READ)

        def pump(until: float | None = None) -> None:
            """Copy the command's output until it closes its pipes (or `until`, a time.monotonic())."""
            nonlocal tail
            while selector.get_map() and (until is None or time.monotonic() < until):
                for key, _ in selector.select(None if until is None else max(until - time.monotonic(), 0)):
                    chunk = os.read(key.fileobj.fileno(), 65536)
                    if not chunk:
                        selector.unregister(key.fileobj)
                        continue
                    sink.write(chunk)
                    sink.flush()
                    if stream:
                        _write(ours[key.fileobj], chunk)
                    if key.fileobj is proc.stderr:
                        tail += chunk
                        if len(tail) > 2 * OUTPUT_TAIL:
                            del tail[:-OUTPUT_TAIL]

        try:
            pump()
            returncode = proc.wait()
        except KeyboardInterrupt:  # Ctrl-C reached the command too (one process group): let it say where it stopped
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                pump(time.monotonic() + INTERRUPT_GRACE)
            finally:
                signal.signal(signal.SIGINT, previous)
            raise
        finally:
            if proc.poll() is None:  # interrupted: do not leave the run behind
                proc.kill()
                proc.wait()
            selector.close()
            proc.stdout.close()
            proc.stderr.close()
    return returncode, bytes(tail[-OUTPUT_TAIL:]).decode("utf-8", "replace")


def _write(stream, chunk: bytes) -> None:
    """Bytes to a text stream: through its buffer when it has one, else decoded (e.g. a captured stream)."""
    buffer = getattr(stream, "buffer", None)
    if buffer is not None:
        buffer.write(chunk)
        buffer.flush()
    else:
        stream.write(chunk.decode("utf-8", "replace"))


def error_message(output: str) -> str:
    """The error that ends a run's output: from the last `config error:` / `XError:` line of its last
    paragraph to the end (lines that rich wrapped are joined back), else that paragraph; '' if none."""
    lines = [_ANSI.sub("", line).rstrip() for line in re.split(r"\r\n|\r|\n", output)]
    lines = [line for line in lines if "HYDRA_FULL_ERROR" not in line]
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        return ""
    block = lines[max((i + 1 for i, line in enumerate(lines) if not line.strip()), default=0) :]
    heads = [i for i, line in enumerate(block) if _ERROR_HEAD.match(line.strip())]
    text = " ".join(line.strip() for line in block[heads[-1] if heads else 0 :])
    return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 3] + "..."


def failure_reason(returncode: int, output: str, summary: dict) -> str:
    """Why a run failed, in one line: its summary's `error`, else the end of its output, else its exit."""
    if isinstance(summary.get("error"), str) and summary["error"].strip():
        text = " ".join(summary["error"].split())
        return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 3] + "..."
    message = error_message(output)
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        killed = f"killed by {name}" + (" (out of memory?)" if name == "SIGKILL" else "")
        return f"{killed}: {message}" if message else killed
    if returncode == 0:
        return message or "exited 0 without a completed summary.json"
    return message or f"exit status {returncode}, nothing in its output"


def read_json(path: Path, summary: bool = False) -> tuple[dict, str | None]:
    """(the JSON object in `path`, or {}; why it could not be used, if it exists but is damaged: `smd_cli.runtime.records`,
    with `summary` its values' ranges checked too)."""
    try:
        return (records.read_summary if summary else records.read_object)(path, missing_ok=True), None
    except (records.Damaged, OSError) as err:
        return {}, f"unusable {path.name} ({err})"


def _workers_watch_this_process() -> None:
    """joblib's worker processes (Hydra's joblib launcher) watch this process from their start, so that an idle one
    dies with the sweep too: its `loky` backend, given an initializer (the launcher cannot pass one)."""
    from joblib import register_parallel_backend
    from joblib._parallel_backends import LokyBackend

    class WatchedLoky(LokyBackend):
        def configure(self, *args, **kwargs):
            return super().configure(*args, initializer=lifetime.watch_parent, initargs=(os.getpid(),), **kwargs)

    register_parallel_backend("loky", WatchedLoky)


def launch(members: list[Member], runs_dir: Path) -> None:
    """Run `members` through the configured Hydra launcher, each in `runs_dir/NAME`. A launcher that breaks
    down (a worker killed) is reported, not raised: its members then have no completed `member.json`."""
    from hydra._internal.callbacks import Callbacks
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.plugins import Plugins
    from hydra.types import HydraContext, RunMode

    hydra = GlobalHydra.instance().hydra if GlobalHydra.instance().is_initialized() else None
    if hydra is None:
        raise RuntimeError("smd ablate launches its members through Hydra: run it as `smd ablate ...`")
    given = list(HydraConfig.get().overrides.hydra) if HydraConfig.initialized() else []
    given = [o for o in given if not o.startswith(("hydra.run.", "hydra.sweep."))]
    loader = hydra.config_loader
    master = loader.load_configuration("train", overrides=[*given, f"hydra.sweep.dir={runs_dir}", "hydra.output_subdir=null"],
                                       run_mode=RunMode.MULTIRUN)
    launcher = Plugins.instance().instantiate_launcher(hydra_context=HydraContext(config_loader=loader, callbacks=Callbacks(master)),
                                                      task_function=run_member, config=master)
    jobs = [[*m.overrides, f"hydra.sweep.subdir={m.name}"] for m in members]
    os.environ[SWEEP_PID] = str(os.getpid())  # inherited by the launcher's workers (`run_member` watches this process)
    _workers_watch_this_process()
    try:
        launcher.launch(jobs, initial_job_idx=0)
    except Exception as err:  # e.g. joblib's TerminatedWorkerError: the members it did not finish are reported failed
        Console(stderr=True).print(f"[red]ablate:[/red] the launcher stopped: {escape(f'{type(err).__name__}: {err}')}", highlight=False)


