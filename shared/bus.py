"""The bus: NATS with typed messages, subjects under one prefix, trace context in headers, and a
payload cap that fails loudly (KV bytes must never ride the bus; they go through Mooncake).

Request/reply subjects are plain core-NATS subjects; no JetStream stream may overlap them (a stream
on an overlapping subject would answer the request itself).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from shared.logging import get_logger
from shared.messages import Message, MessageError
from shared.tracing import extract_context, inject_headers

log = get_logger("bus")
HEADER_ROOM_BYTES = 64 * 1024  # the server's max_payload counts headers (trace context) too
DEFAULT_MAX_MESSAGE_BYTES = (8 << 20) - HEADER_ROOM_BYTES  # under the embedded server's 8 MiB max_payload
DRAIN_TIMEOUT_S = 2.0  # close(): handlers still running get this long, then the connection closes under them


class PayloadTooLarge(RuntimeError):
    """A message over the cap: almost certainly bulk data sent the wrong way."""


@dataclass
class BusConfig:
    url: str = "nats://127.0.0.1:4222"  # NATS server(s) to connect to
    prefix: str = "moorage"             # subject prefix: deployments sharing a NATS server stay apart
    user: str = ""                      # NATS user/password auth
    password: str = ""                  # (with user)
    token: str = ""                     # NATS token auth
    creds_file: str = ""          # NATS decentralized auth (.creds)
    tls_ca: str = ""              # set to use TLS (with tls_cert/tls_key for mutual TLS)
    tls_cert: str = ""                  # client certificate (mutual TLS)
    tls_key: str = ""                   # client key (mutual TLS)
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # larger messages fail loudly (also kept under the server's max_payload): bulk data goes via Mooncake
    request_timeout_s: float = 5.0      # default timeout of a request/reply on the bus
    connect_timeout_s: float = 5.0      # initial connection timeout


@dataclass(frozen=True)
class Subjects:
    prefix: str = "moorage"

    @property
    def gate_admit(self) -> str:
        return f"{self.prefix}.gate.admit"

    @property
    def gate_release(self) -> str:
        return f"{self.prefix}.gate.release"

    @property
    def holdings(self) -> str:
        """A router's Holdings: read by the gate (lost Releases) and the engines (orphaned requests)."""
        return f"{self.prefix}.router.holdings"

    def prefill_submit(self, instance: str) -> str:
        return f"{self.prefix}.prefill.{instance}.submit"

    def prefill_assign(self, instance: str) -> str:
        return f"{self.prefix}.prefill.{instance}.assign"

    def decode_slots(self, instance: str) -> str:
        return f"{self.prefix}.decode.{instance}.slots"

    def decode_filled(self, instance: str) -> str:
        return f"{self.prefix}.decode.{instance}.filled"

    def decode_pages(self, instance: str) -> str:
        return f"{self.prefix}.decode.{instance}.pages"

    def decode_pages_released(self, instance: str) -> str:
        return f"{self.prefix}.decode.{instance}.pages_released"

    def decode_pages_landed(self, instance: str) -> str:
        return f"{self.prefix}.decode.{instance}.pages_landed"

    def decode_landed(self, instance: str) -> str:
        return f"{self.prefix}.decode.{instance}.landed"

    def request_out(self, request_id: str) -> str:
        return f"{self.prefix}.req.{request_id}.out"

    def cancel(self, request_id: str) -> str:
        return f"{self.prefix}.cancel.{request_id}"

    @property
    def cancel_all(self) -> str:
        return f"{self.prefix}.cancel.*"

    @property
    def session_close(self) -> str:
        return f"{self.prefix}.session.close"

    @property
    def session_turn(self) -> str:
        return f"{self.prefix}.session.turn"

    def load(self, role: str, instance: str) -> str:
        return f"{self.prefix}.load.{role}.{instance}"

    @property
    def load_all(self) -> str:
        return f"{self.prefix}.load.>"

    def exited(self, role: str, instance: str) -> str:
        """An InstanceExited: a supervisor saw this instance's process end."""
        return f"{self.prefix}.exited.{role}.{instance}"

    @property
    def exited_all(self) -> str:
        return f"{self.prefix}.exited.>"

    def kv_events(self, instance: str) -> str:
        return f"{self.prefix}.kv.events.{instance}"

    @property
    def disk_spill(self) -> str:
        return f"{self.prefix}.store.disk.spill"

    @property
    def disk_drop(self) -> str:
        return f"{self.prefix}.store.disk.drop"

    @property
    def disk_index(self) -> str:
        return f"{self.prefix}.store.disk.index"

    @property
    def disk_sync(self) -> str:
        return f"{self.prefix}.store.disk.sync"

    def disk_load(self, store: str) -> str:
        return f"{self.prefix}.store.{store}.disk.load"


Handler = Callable[[Message, Msg], Awaitable[Message | None]]


def _redact(url: str) -> str:
    """A bus URL without its credential (nats://user:password@host:port -> nats://host:port)."""
    scheme, sep, rest = url.partition("://")
    return scheme + sep + rest.rsplit("@", 1)[-1] if sep else url.rsplit("@", 1)[-1]


@dataclass
class _ConnectionLog:
    """One log line when the bus goes away (with the first error) and one when it is back; and since when
    the connection has been up (`Bus.heard_since`)."""
    name: str
    url: str
    down: bool = False
    up_since: float = field(default_factory=time.monotonic)

    async def on_error(self, e: Exception) -> None:
        if not self.down:
            self.down = True
            log.warning("bus unreachable, retrying", client=self.name, url=self.url,
                        error=f"{type(e).__name__}: {e}")

    async def on_disconnected(self) -> None:
        if not self.down:
            self.down = True
            log.warning("bus disconnected, reconnecting", client=self.name, url=self.url)

    async def on_reconnected(self) -> None:
        self.down = False
        self.up_since = time.monotonic()
        log.info("bus reconnected", client=self.name, url=self.url)


@dataclass
class Bus:
    nc: NATS
    config: BusConfig
    subjects: Subjects = field(init=False)
    connection_log: _ConnectionLog | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.subjects = Subjects(self.config.prefix)

    @classmethod
    async def connect(cls, config: BusConfig, name: str, **callbacks) -> "Bus":
        """Connected, or retrying for ever: the first connect too waits while the server (re)starts, and a
        lost connection is retried every 0.5 s without end, subscriptions restored by the client. Each
        outage is logged once (no traceback per try); callbacks given here replace that."""
        watch = _ConnectionLog(name, _redact(config.url))
        callbacks = {"error_cb": watch.on_error, "disconnected_cb": watch.on_disconnected,
                     "reconnected_cb": watch.on_reconnected, **callbacks}
        opts: dict = dict(servers=[config.url], name=name, connect_timeout=config.connect_timeout_s,
                          max_reconnect_attempts=-1, reconnect_time_wait=0.5, drain_timeout=DRAIN_TIMEOUT_S,
                          **callbacks)
        if config.user:
            opts.update(user=config.user, password=config.password)
        if config.token:
            opts["token"] = config.token
        if config.creds_file:
            opts["user_credentials"] = config.creds_file
        if config.tls_ca:
            import ssl

            ctx = ssl.create_default_context(cafile=config.tls_ca)
            if config.tls_cert:
                ctx.load_cert_chain(config.tls_cert, config.tls_key or None)
            opts["tls"] = ctx
        return cls(await nats.connect(**opts), config, watch)

    def heard_since(self, now: float) -> float:
        """Since when (monotonic) this client has been able to hear the bus without a break: `now` while it
        is cut off. Silence from a peer counts only from then (a peer is not gone because we were deaf)."""
        watch = self.connection_log
        if watch is None:
            return float("-inf")
        return now if watch.down else watch.up_since

    @property
    def max_message_bytes(self) -> int:
        """The cap in force: the configured one, or less when the server takes less (its max_payload)."""
        server = getattr(self.nc, "max_payload", None)
        if isinstance(server, int) and server > 0:
            return min(self.config.max_message_bytes, max(server - HEADER_ROOM_BYTES, server // 2))
        return self.config.max_message_bytes

    def pack(self, msg: Message) -> bytes:
        """A message's bytes for the bus, within the cap (PayloadTooLarge otherwise). `request` takes them
        in place of the message: a sender may encode a message ahead, while it waits for something else."""
        data = msg.encode()
        cap = self.max_message_bytes
        if len(data) > cap:
            raise PayloadTooLarge(f"{msg.KIND} message of {len(data)} bytes exceeds the bus cap of "
                                  f"{cap}: bulk data belongs on the transfer engine")
        return data

    async def publish(self, subject: str, msg: Message) -> None:
        await self.nc.publish(subject, self.pack(msg), headers=inject_headers())

    async def request(self, subject: str, msg: Message | bytes, reply_type: type[Message],
                      timeout: float | None = None) -> Message:
        """`msg`'s reply, decoded as reply_type; msg may be a message's `pack`ed bytes."""
        data = msg if isinstance(msg, bytes) else self.pack(msg)
        resp = await self.nc.request(subject, data, timeout=timeout or self.config.request_timeout_s,
                                     headers=inject_headers())
        return reply_type.decode(resp.data)

    async def respond(self, req: Msg, msg: Message) -> None:
        if req.reply:
            await self.nc.publish(req.reply, self.pack(msg))

    async def subscribe(self, subject: str, msg_type: type[Message], handler: Handler, queue: str = "",
                        on_error: Callable[[Exception, Msg], Message | None] | None = None,
                        concurrent: bool = False):
        """Decode each message as msg_type and call handler(message, raw). A returned message is the
        reply. Malformed messages (and handler exceptions) are answered by on_error, if given;
        malformed messages never reach the handler. Messages are handled one at a time, in order,
        unless `concurrent`: then each in its own task, so a handler that waits holds up no other."""
        async def handle(raw: Msg) -> None:
            try:
                msg = msg_type.decode(raw.data)
            except MessageError as e:
                reply = on_error(e, raw) if on_error else None
                if reply is not None:
                    await self.respond(raw, reply)
                return
            try:
                reply = await handler(msg, raw)
            except Exception as e:  # a failing handler must answer, not leave the requester hanging
                log.exception("handler failed", subject=raw.subject, kind=msg.KIND)
                reply = on_error(e, raw) if on_error else None
            if reply is not None:
                await self.respond(raw, reply)

        tasks: set[asyncio.Task] = set()

        async def spawn(raw: Msg) -> None:
            task = asyncio.create_task(handle(raw))
            tasks.add(task)  # referenced until done
            task.add_done_callback(tasks.discard)

        return await self.nc.subscribe(subject, queue=queue, cb=spawn if concurrent else handle)

    @staticmethod
    def trace_context(raw: Msg):
        """The sender's trace context (use as the parent of this side's span)."""
        return extract_context(raw.headers)

    async def close(self) -> None:
        if self.connection_log is not None:
            self.connection_log.down = True  # closing on purpose: no "disconnected" warning
        if not self.nc.is_closed:
            # The client's own drain_timeout bounds it: cancelling a drain from outside (wait_for) left its
            # subscriptions' gathered drains failed with CancelledError and unread, logged at every stop
            # as "_GatheringFuture exception was never retrieved".
            try:
                await self.nc.drain()
            except Exception:
                await self.nc.close()
