"""`moorage up`: the whole system on one machine, as real processes.

Starts a nats-server (unless `up.nats_url` names one), then the KV pool (a master supervising
`mooncake_master` and `up.stores` store services, "the two halves of the host"), the gate, decode,
`up.prefills` prefill instances and the router, each `moorage serve <role> --config
<run_dir>/<instance>.toml`: the one entry point compose and systemd use too, with other files. Prints the
URL once /health answers 200, and on Ctrl-C/SIGTERM stops everything in reverse order, a wave of STOP_WAVES
at a time. Once ready, a service (or the nats-server) that crashes is restarted
with backoff while the others keep serving (`up.restart`, like systemd's Restart=on-failure). Children
get PDEATHSIG, so none outlives a killed launcher, and the next start cleans up what such a launcher left
in the run directory. The embedded nats-server requires a user/password made for this run
(`nats-credential.json` in the run directory, mode 0600, as are the per-instance TOMLs holding it).

Config keys: `up.*` below, plus every key of every service under its name, e.g.
`--set prefill.engine.num_blocks=4096 --set router.router.port=8080`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from infra.exits import ExitAnnouncer, new_boot
from infra.disk_split import DiskSplit, split_disk
from infra.kv_split import KVSplit, measure_kv
from infra.natsd import CREDENTIAL_FILE, NatsCredential, NatsServer, write_private
from infra.procs import ProcId, die_with_parent
from infra.runstate import NATS_DIR, STATE_FILE, clean_stale, write_state
from infra.supervise import RestartPolicy, Supervisor, describe_exit
from infra.tomlgen import to_toml
from services.decode.config import DecodeConfig
from services.gate.config import GateConfig
from services.master.config import MasterConfig
from services.prefill.config import PrefillConfig
from services.router.config import RouterConfig
from services.store.config import StoreConfig
from shared.config import ConfigError
from shared.engine.kv_sizing import parse_memory
from shared.messages import InstanceExited
from shared.service import BOOT_ENV
from shared.sockets import free_port, listen, url_of

CLI_MODULE = "infra.cli"  # `python -m CLI_MODULE serve ROLE`: `moorage serve` with this interpreter
READY_ROLES = ("gate", "prefill", "decode")  # the roles the router's /health lists by instance

NATS_CHILD = "nats-server"  # the embedded bus, supervised like the services
# Roles stopped together, in reverse start order (the nats-server last, alone): what a later wave serves, an
# earlier one may still use as it stops (prefill's last pool saves need the stores; a store unmounts its
# segment through its master). The engines stop together, then the gate with the stores.
STOP_WAVES = {"router": 0, "prefill": 1, "decode": 1, "gate": 2, "store": 2, "master": 3}


@dataclass
class UpSettings:
    model: str = "smollm2-135m"       # served by prefill and decode, tokenized by the router
    host: str = "127.0.0.1"           # router bind address (loopback unless you mean it)
    port: int = 8000                  # router port (0: any free one; the URL is printed). Bound by moorage up itself and handed to the router
    nats_url: str = ""                # empty: start an embedded nats-server on a free loopback port
    run_dir: str = ".moorage"         # configs, logs, traces, state for `moorage status`
    ready_timeout_s: float = 300.0    # give up if /health is not 200 by then
    pool: bool = True                 # run the KV pool (master + stores) and let prefill use it
    pool_mode: str = "shared"         # shared: every group's stores join one pool; split: a pool per group
    groups: int = 1                   # "servers": each group has its prefills, its stores and one decode
    stores: int = 2                   # store services per group contributing DRAM to the pool
    store_bytes: int = 1 << 30        # DRAM each store contributes (bytes)
    disk_bytes: int = -1              # each store's disk tier (store.disk_path: <disk_dir>/<store instance>): -1 = auto, a quarter of that filesystem's free space, 64 GiB at most in all, split among the stores (infra/disk_split.py); a size in bytes per store; 0 = none, the pool is DRAM only
    disk_dir: str = ""                # where the stores' disk tiers live ("": <run_dir>/disk); local NVMe on a server
    prefills: int = 1                 # prefill instances per group
    kv_memory: str = "60%"            # KV of all prefill + decode instances: a share of the host memory left after stores and processes, or a size ("8GiB")
    decode_kv_share: float = 0.5      # of that, the decode instances' part (the rest is the prefills' device prefix cache)
    nats_auth: bool = True            # embedded nats-server: require a user/password made for this run (0600 in run_dir)
    restart: str = "on-failure"       # on-failure: restart a service or nats-server that crashed (others keep serving) | no
    restart_backoff_s: float = 0.5    # first restart delay; doubles per consecutive crash
    restart_backoff_max_s: float = 10.0  # cap of the restart delay
    restart_reset_s: float = 30.0     # a run that lasted this long resets the delay
    trace_ui: str = ""                # phoenix: start Arize Phoenix (the [ui] extra, else .venv-phoenix) and send every service's spans there too | "" (none)

    def __post_init__(self) -> None:
        if self.pool_mode not in ("shared", "split"):
            raise ConfigError(f"up.pool_mode must be shared or split, got {self.pool_mode!r}")
        if self.disk_bytes < -1:
            raise ConfigError(f"up.disk_bytes must be -1 (auto), 0 (no disk tier) or a size, got {self.disk_bytes}")
        if min(self.groups, self.prefills) < 1 or self.stores < 0:
            raise ConfigError("up.groups and up.prefills must be >= 1, up.stores >= 0")
        if not 0 < self.decode_kv_share < 1:
            raise ConfigError(f"up.decode_kv_share must be in (0, 1), got {self.decode_kv_share}")
        try:
            parse_memory(self.kv_memory)
        except ValueError as e:
            raise ConfigError(f"up.kv_memory: {e}") from None
        if self.trace_ui not in ("", "phoenix"):
            raise ConfigError(f"up.trace_ui must be phoenix or empty, got {self.trace_ui!r}")
        try:
            RestartPolicy(self.restart, self.restart_backoff_s, self.restart_backoff_max_s, self.restart_reset_s)
        except ConfigError as e:
            raise ConfigError(f"up.{e}") from None


@dataclass
class UpConfig:
    up: UpSettings = field(default_factory=UpSettings)
    master: MasterConfig = field(default_factory=MasterConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    prefill: PrefillConfig = field(default_factory=PrefillConfig)
    router: RouterConfig = field(default_factory=RouterConfig)


def _replace(obj, **sections):
    """dataclasses.replace on nested sections: _replace(cfg, bus={"url": u}) -> a copy with bus.url = u."""
    return dataclasses.replace(obj, **{k: dataclasses.replace(getattr(obj, k), **v) for k, v in sections.items()})


def _sized_by_up(engine) -> bool:
    return engine.num_blocks == 0 and engine.kv_memory == "auto"


def check_layout(cfg: UpConfig) -> None:
    """Refuse, before anything starts, a parallel layout the model cannot take (naming the key and the limit)."""
    if cfg.prefill.pp > 1:
        from shared.engine.models import load_model_meta

        layers = load_model_meta(cfg.up.model)[1].num_layers
        if cfg.prefill.pp > layers:
            raise ConfigError(f"prefill.pp = {cfg.prefill.pp}: more pipeline ranks than {cfg.up.model}'s {layers} "
                              "layers (each rank holds at least one layer)")


def disk_of(cfg: UpConfig, run_dir: Path) -> DiskSplit:
    """The stores' disk tier for this system (infra/disk_split.py)."""
    up = cfg.up
    return split_disk(up.disk_bytes, Path(up.disk_dir or run_dir / "disk"), up.groups * up.stores if up.pool else 0)


def plan(cfg: UpConfig, nats_url: str, run_dir: Path, kv: KVSplit | None = None,
         credential: NatsCredential | None = None, router_fd: int = -1,
         disk: DiskSplit | None = None) -> list[tuple[str, str, object]]:
    """(instance, service module, config) in start order; stop order is the reverse. Engines whose KV is
    left to "auto" get their part of `kv` (the host's split; measured now when not given). Every service
    gets `credential` (the embedded bus's) as its bus user/password; the router serves on `router_fd`
    (the launcher's listening socket) when it is given. `disk`: the stores' disk tier (sized now when not given)."""
    up = cfg.up
    disk = disk or disk_of(cfg, run_dir)
    check_layout(cfg)
    if kv is None and (_sized_by_up(cfg.decode.engine) or _sized_by_up(cfg.prefill.engine)):
        kv = measure_kv(cfg)

    def engine(sc, part: int) -> dict:
        return {"model": up.model, **({"kv_memory": str(part)} if _sized_by_up(sc.engine) else {})}
    common = {"bus": {"url": nats_url, **({"user": credential.user, "password": credential.password}
                                          if credential else {})}}
    traces = str(run_dir / "traces.jsonl")
    out: list[tuple[str, str, object]] = []

    def add(instance: str, service: str, sc, **sections) -> None:
        sc = _replace(dataclasses.replace(sc, instance=instance), **common, **sections)
        if sc.tracing.exporter == "jsonl" and sc.tracing.path == "moorage-traces.jsonl":
            sc = _replace(sc, tracing={"path": traces})
        out.append((instance, service, sc))

    # Instances are numbered across groups (prefill-0..G*P-1, decode-0..G-1, store-0..G*S-1); the
    # group only decides which pool a prefill uses when pools are split.
    pools: list[str] = []  # master address per pool
    if up.pool:
        for m in range(up.groups if up.pool_mode == "split" else 1):
            port = free_port()  # never collide with another pool on this host
            pools.append(f"{cfg.master.master.host}:{port}")
            add(f"master-{m}", "master", cfg.master, master={"rpc_port": port})
        for g in range(up.groups):
            for i in range(up.stores):
                name = f"store-{g * up.stores + i}"
                tier = {"disk_path": str(disk.directory / name), "disk_bytes": disk.per_store} if disk.per_store else {}
                add(name, "store", cfg.store,
                    store={"master_addr": pools[g % len(pools)], "segment_bytes": up.store_bytes, **tier})
    add(cfg.gate.instance, "gate", cfg.gate)
    for g in range(up.groups):
        add(f"decode-{g}", "decode", cfg.decode, engine=engine(cfg.decode, kv and kv.decode_bytes))
    for g in range(up.groups):
        for i in range(up.prefills):
            pool = {"enabled": True, "master_addr": pools[g % len(pools)]} if up.pool else {"enabled": False}
            add(f"prefill-{g * up.prefills + i}", "prefill", cfg.prefill,
                engine=engine(cfg.prefill, kv and kv.prefill_bytes), pool=pool)
    add(cfg.router.instance, "router", cfg.router,
        router={"model": up.model, "host": up.host, "port": up.port, "listen_fd": router_fd})
    return out


class Launcher:
    """Starts, supervises (restart on failure, see infra/supervise.py) and stops one system. Every
    process is spawned by the supervisor's thread, which lives until `stop()`: children get
    PR_SET_PDEATHSIG from it, so a launcher killed with kill -9 takes all of them along."""

    def __init__(self, cfg: UpConfig, say=None):
        self.cfg = cfg
        up = cfg.up
        self.run_dir = Path(up.run_dir).resolve()
        self.configs: dict[str, object] = {}          # instance -> the config it was started with
        self.roles: dict[str, str] = {}               # instance -> its service (role)
        self.boots: dict[int, str] = {}               # pid -> the incarnation it was given (MOORAGE_BOOT)
        self.announcer: ExitAnnouncer | None = None   # publishes InstanceExited for a child that ended
        self.nats: NatsServer | None = None
        self.credential: NatsCredential | None = None
        self.kv: KVSplit | None = None
        self.disk: DiskSplit | None = None  # the stores' disk tier, sized at start
        self.nats_address = ""
        self.router_url = ""
        self.router_sock: socket.socket | None = None  # bound here, served by the router (router.listen_fd)
        self.trace_ui = None  # infra.trace_ui.Phoenix when up.trace_ui is set
        self.started = time.time()
        self._owns_run_dir = False  # set once clean_stale found no other live launcher there
        self._say = say or (lambda line: print(f"moorage: {line}", flush=True))
        self.supervisor = Supervisor(
            RestartPolicy(up.restart, up.restart_backoff_s, up.restart_backoff_max_s, up.restart_reset_s),
            say=self._event, on_change=lambda _: self._write_state(), on_exit=self._exited,
            stop_wave=lambda name: STOP_WAVES.get(self.roles.get(name, name), name))

    @property
    def procs(self) -> dict[str, subprocess.Popen]:
        """instance -> its current process, in start order (nats-server not included)."""
        return {n: c.process for n, c in self.supervisor.children.items() if n != NATS_CHILD and c.process}

    def _event(self, line: str) -> None:
        self._say(line)
        with open(self.run_dir / "up.log", "a") as f:  # the launcher's own log: starts, exits, restarts
            f.write(json.dumps({"timestamp": time.time(), "event": line}) + "\n")

    def _exited(self, name: str, proc: subprocess.Popen, returncode: int) -> None:
        """On the supervisor thread, as waitpid returns: tell the bus (routers, gates and engines act on it
        at once; infra/exits.py). The nats-server's own end is not announced: nobody would hear it."""
        role, boot = self.roles.get(name), self.boots.pop(proc.pid, "")
        if role is None or self.announcer is None:
            return
        self.announcer.announce(InstanceExited(role, name, boot, describe_exit(returncode), False, proc.pid,
                                               "moorage-up"), self.configs[name].bus.prefix)

    def _write_state(self) -> None:
        children = self.supervisor.children
        procs = {n: ProcId.of(c.process.pid) for n, c in children.items() if c.process and c.process.poll() is None}
        write_state(self.run_dir, {
            "nats_url": self.nats_address, "router_url": self.router_url, "run_dir": str(self.run_dir),
            "credential_file": CREDENTIAL_FILE if self.credential else "", "started": self.started,
            "launcher": ProcId.of(os.getpid()).to_json(),
            "pids": {n: p.pid for n, p in procs.items() if p},
            "procs": {n: p.to_json() for n, p in procs.items() if p},
            "restarts": {n: c.restarts for n, c in children.items()},
            "last_exit": {n: c.last_exit for n, c in children.items() if c.last_exit}})

    def _start_nats(self) -> str:
        if not self.cfg.up.nats_auth:
            self.credential = None
        else:
            self.credential = NatsCredential.generate()
            self.credential.save(self.run_dir / CREDENTIAL_FILE)
        self.nats = NatsServer(str(self.run_dir / NATS_DIR), credential=self.credential,
                               log_path=str(self.run_dir / "nats.log"), die_with_parent=True)
        self.supervisor.add(NATS_CHILD, self.nats.spawn)
        return self.nats.wait_port()

    def _spawner(self, service: str, path: Path, pass_fds: tuple[int, ...] = ()):
        def spawn() -> subprocess.Popen:
            boot = new_boot()  # the process's incarnation: its load reports and its exit announcement name it
            with open(self.run_dir / f"{path.stem}.log", "ab") as log:
                proc = subprocess.Popen([sys.executable, "-m", CLI_MODULE, "serve", service, "--config", str(path)],
                                        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                        pass_fds=pass_fds, preexec_fn=die_with_parent(),
                                        env={**os.environ, BOOT_ENV: boot})
            self.boots[proc.pid] = boot
            return proc
        return spawn

    def start(self) -> str:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for line in clean_stale(self.run_dir):
            self._say(line)
        self._owns_run_dir = True
        self.router_sock = listen(self.cfg.up.host, self.cfg.up.port, "router", backlog=2048)
        self.router_url = url_of(self.router_sock)
        router_fd = self.router_sock.fileno()
        self.nats_address = self.cfg.up.nats_url or self._start_nats()
        bus = self.cfg.gate.bus  # the services' bus settings (plan() gives every one this URL and credential)
        self.announcer = ExitAnnouncer(dataclasses.replace(bus, url=self.nats_address, **(
            {"user": self.credential.user, "password": self.credential.password} if self.credential else {})),
            "moorage-up")
        if _sized_by_up(self.cfg.decode.engine) or _sized_by_up(self.cfg.prefill.engine):
            self.kv = measure_kv(self.cfg)
        if self.cfg.up.trace_ui:  # before the services: they export to it from their first span
            from infra.trace_ui import export_to, start_trace_ui
            self.trace_ui = start_trace_ui(self.cfg.up.trace_ui, self.run_dir, self._say)
            self.cfg = export_to(self.cfg, self.trace_ui.url, self.run_dir / "traces.jsonl")
        self.disk = disk_of(self.cfg, self.run_dir)
        for instance, service, config in plan(self.cfg, self.nats_address, self.run_dir, self.kv, self.credential,
                                              router_fd=router_fd, disk=self.disk):
            self.configs[instance], self.roles[instance] = config, service
            path = self.run_dir / f"{instance}.toml"
            write_private(path, to_toml(config))  # may hold the bus credential: 0600
            self.supervisor.add(instance, self._spawner(service, path, (router_fd,) if service == "router" else ()))
        return self.router_url

    def dead(self) -> list[str]:
        """Instances whose process is not running now (crashed and not yet restarted, or stopped)."""
        return [n for n, p in self.procs.items() if p.poll() is not None]

    def restarts(self) -> dict[str, int]:
        return {n: c.restarts for n, c in self.supervisor.children.items()}

    def wait_ready(self, url: str) -> dict:
        """Until the router's /health lists every gate, prefill and decode started here as ready: a
        request sent earlier would be routed as if the missing instances did not exist. Returns /health.
        A process that exits meanwhile fails the start; once this returns, crashes are restarted."""
        deadline = time.monotonic() + self.cfg.up.ready_timeout_s
        expected = {name for name in self.procs if name.rsplit("-", 1)[0] in READY_ROLES}
        missing = expected
        while time.monotonic() < deadline:
            if self.supervisor.failed:
                raise RuntimeError(f"{', '.join(self.supervisor.failed)} exited during start-up; see "
                                   f"{self.run_dir}/*.log" + "".join(map(self._last_words, self.supervisor.failed)))
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    health = json.loads(r.read())
                    ready = health.get("ready", {})
                    missing = expected - {i for instances in ready.values() for i in instances}
                    if r.status == 200 and not missing:
                        self.supervisor.arm()
                        return health
            except (OSError, ValueError):
                pass
            self.supervisor.failed_event.wait(0.3)  # wakes at once if a process exits
        raise TimeoutError(f"not ready after {self.cfg.up.ready_timeout_s:.0f} s (not reported ready: "
                           f"{', '.join(sorted(missing)) or '-'}); see {self.run_dir}/*.log"
                           + "".join(map(self._last_words, sorted(missing) + [self.cfg.router.instance])))

    def _last_words(self, instance: str, lines: int = 15) -> str:
        """How `instance` ended and the last lines of its log, for an error that names it."""
        child = self.supervisor.children.get(instance)
        try:
            with open(self.run_dir / f"{instance}.log", "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 16384))
                tail = f.read().decode(errors="replace").splitlines()[-lines:]
        except OSError as e:
            tail = [f"(no log: {e.strerror})"]
        return f"\n--- {instance} ({(child.last_exit or 'running') if child else '?'}), last lines of its log:\n" + "\n".join(tail)

    def stop(self, timeout: float = 15.0) -> None:
        announcer, self.announcer = self.announcer, None  # a stop we ask for is not announced (services say
        if announcer is not None:                           # goodbye themselves); closed while the bus is up
            announcer.close()
        self.supervisor.stop(timeout)
        if self.trace_ui is not None:  # after the services: their last spans are flushed to it
            self.trace_ui.stop()
        if self.nats is not None:
            self.nats.stop()
        if self.router_sock is not None:
            self.router_sock.close()
        if self._owns_run_dir:  # never another launcher's (one that refused to start next to it)
            (self.run_dir / STATE_FILE).unlink(missing_ok=True)
            (self.run_dir / CREDENTIAL_FILE).unlink(missing_ok=True)


@contextlib.contextmanager
def launched(cfg: UpConfig) -> Iterator[tuple[Launcher, str]]:
    """(launcher, router URL) of a started system whose every instance reported ready; stopped on exit."""
    with launched_side_by_side({"": cfg}) as systems:
        yield systems[""]


@contextlib.contextmanager
def launched_side_by_side(cfgs: dict[str, UpConfig]) -> Iterator[dict[str, tuple[Launcher, str]]]:
    """Several systems on one host (a comparison run side by side): {name: (launcher, router URL)} once every
    one reported ready. All are started before any is waited for, so their start-ups overlap, and on exit
    all stop at once, one thread each."""
    launchers: dict[str, Launcher] = {}
    try:
        urls = {}
        for name, cfg in cfgs.items():
            launchers[name] = Launcher(cfg)
            urls[name] = launchers[name].start()
        for name, launcher in launchers.items():
            launcher.wait_ready(urls[name])
        yield {name: (launcher, urls[name]) for name, launcher in launchers.items()}
    finally:
        stopping = [threading.Thread(target=launcher.stop, name=f"stop-{name}") for name, launcher in launchers.items()]
        for t in stopping:
            t.start()
        for t in stopping:
            t.join()


def _wait_for_signal() -> None:
    """Block until SIGTERM/SIGINT, whichever thread the kernel delivers it to: Python's C handler writes
    every signal to the wakeup fd, so this read returns and the handler (which raises) runs here. A plain
    Event.wait() would sleep through a signal delivered to the supervisor's threads."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    previous = signal.set_wakeup_fd(w)
    try:
        while True:
            os.read(r, 1)
    finally:
        signal.set_wakeup_fd(previous)
        os.close(r)
        os.close(w)


def run_up(cfg: UpConfig) -> int:
    launcher = Launcher(cfg)

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGINT):  # SIGINT too: a background launcher inherits it ignored
        signal.signal(sig, on_signal)
    code = 0
    try:
        url = launcher.start()
        print(f"moorage: starting {', '.join(launcher.procs)} with model {cfg.up.model} "
              f"(logs in {launcher.run_dir})", flush=True)
        if launcher.kv is not None:
            print(f"moorage: {launcher.kv.describe()}", flush=True)
        if cfg.up.pool:
            print(f"moorage: {launcher.disk.describe()}", flush=True)
        health = launcher.wait_ready(url)
        tokens = health.get("kv_tokens", {})
        if tokens:
            print("moorage: KV tokens per instance: " + ", ".join(f"{i} {n:,}" for i, n in sorted(tokens.items())),
                  flush=True)
        print(f"moorage is ready: {url}/v1  (OpenAI-compatible; Ctrl-C stops everything)", flush=True)
        if launcher.trace_ui is not None:
            print(f"moorage traces: {launcher.trace_ui.url}  (Phoenix; `moorage trace breakdown` in the terminal)",
                  flush=True)
        _wait_for_signal()  # the supervisor thread does the rest
    except KeyboardInterrupt:
        print("moorage: stopping", flush=True)
    except (RuntimeError, TimeoutError) as e:
        print(f"moorage: {e}", file=sys.stderr)
        code = 1
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        launcher.stop()
    print("moorage: stopped", flush=True)
    return code
