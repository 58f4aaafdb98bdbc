"""ZmqConnector: prefill/decode disaggregation with vLLM's NIXL protocol on the HTTP side and the KV bytes
over TCP (ZMQ).

The HTTP protocol is vLLM's (``NixlConnector``), so that vllm-router's ``--vllm-pd-disaggregation`` mode
(and vLLM's ``toy_proxy_server.py``) front tinyvllm unchanged:

1. The router sends the request to a **prefill** engine with ``max_tokens: 1``, ``stream: false`` and
   ``kv_transfer_params: {"do_remote_decode": true, ...}``. The engine computes the prompt, samples one
   token (discarded by the router) and, instead of freeing the request's blocks, keeps them
   (:meth:`ZmqConnector.request_finished` returns ``delay_free``). Its response carries
   ``kv_transfer_params``: ``do_remote_prefill: true``, ``remote_engine_id``, ``remote_request_id``,
   ``remote_block_ids`` (the prompt's blocks, in order), ``remote_host`` / ``remote_port`` (this engine's
   side channel), ``tp_size``, and ``remote_block_size`` / ``remote_num_tokens`` (checked by the decode side).
2. The router sends the original request, with those ``kv_transfer_params``, to a **decode** engine. Its
   scheduler allocates blocks for the prompt's first ``len(prompt) - 1`` tokens beyond its own prefix-cache
   hits (:meth:`get_num_new_matched_tokens`), the request waits as ``WAITING_FOR_REMOTE_KVS``, and the worker
   half pulls the matching remote blocks over a ZMQ DEALER socket from the prefill engine's side channel (a
   ROUTER socket served by a thread). When the bytes are in the KV cache the request is scheduled with
   ``num_computed_tokens = len(prompt) - 1``: the decode engine computes one token of the prompt, then decodes.
3. The prefill engine frees the blocks once they were sent, when the decode engine releases them (it aborted
   first), or after ``TINYVLLM_KV_ABORT_REQUEST_TIMEOUT`` seconds (vLLM's ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``)
   if nobody pulls them. Its worker registers the kept blocks when the step after the request finished
   binds its metadata, while the client may already hold the ``kv_transfer_params``: a pull that comes
   first is answered "unknown" and asked again; a release that comes first is remembered (for the timeout)
   and frees the blocks as they are registered.

Any failure of a pull (peer unreachable within ``transfer_timeout``, blocks already freed, another model or KV
layout, another prompt, a block size that differs) makes the decode engine free what it allocated and compute
the prompt itself: the tokens are those of a single engine, never others. A pull checks the model fingerprint
(model, dtype, KV tensor shapes and dtypes) and a hash of the prompt's token ids on the prefill side.

What crosses the wire per request: one frame per KV cache tensor (today one per layer,
``[2, n, block_size, num_kv_heads, head_dim]`` in the cache's dtype) of the ``n`` pulled blocks, copied as
raw bytes: whatever the KV cache holds (a quantized cache's blocks and scales travel the same way).

``kv_connector_extra_config`` keys: ``side_channel_host`` (the address put in ``remote_host`` and bound,
default ``127.0.0.1``; on a cluster the node's reachable address), ``side_channel_port`` (default 0: a free
port, reported in ``remote_port``), ``transfer_timeout`` (seconds a pull may take before the decode engine
recomputes, default 10), ``abort_request_timeout`` (seconds; overrides the environment variable).

Sources: vLLM ``vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py`` (the protocol, the delayed
free and its timeout), vllm-router ``src/routers/http/vllm_pd_router.rs`` (the two-stage request); read, not
copied. NIXL would replace the byte path only (docs/disaggregation.md).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
import warnings
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
import xxhash
import zmq

from tinyvllm import envs
from tinyvllm.config import KVTransferConfig
from tinyvllm.distributed.kv_transfer.base import KVConnectorBase_V1, KVConnectorRole
from tinyvllm.outputs import KVConnectorOutput
from tinyvllm.request import Request, RequestStatus

logger = logging.getLogger("tinyvllm")

_EXTRA_KEYS = ("side_channel_host", "side_channel_port", "transfer_timeout", "abort_request_timeout")
_GONE_MEMORY = 4096  # request ids the side channel remembers as already sent / freed ("gone", not "unknown")
_UNKNOWN_RETRY_S = 0.005  # a pull that arrives before the prefill engine registered its send is retried


def prompt_hash(token_ids: list[int]) -> str:
    """xxh3-128 of the prompt's token ids (hex): both engines must hold KV of the same tokens."""
    return xxhash.xxh3_128_hexdigest(array("q", token_ids).tobytes())


# ----------------------------------------------------------------------------- scheduler -> worker


class LoadSpec(msgspec.Struct, array_like=True):
    """Pull ``remote_block_ids`` of ``remote_request_id`` from ``remote_host:remote_port`` into
    ``local_block_ids`` (same length, logical order) for the local request ``req_id``."""

    req_id: str
    local_block_ids: list[int]
    remote_block_ids: list[int]
    remote_host: str
    remote_port: int
    remote_request_id: str
    prompt_hash: str


class SendSpec(msgspec.Struct, array_like=True):
    """Serve ``block_ids`` (the prompt's blocks) of finished request ``req_id`` until pulled or expired."""

    req_id: str
    block_ids: list[int]
    prompt_hash: str


class Release(msgspec.Struct, array_like=True):
    """Tell the prefill engine at ``host:port`` that ``remote_request_id``'s blocks will not be pulled."""

    host: str
    port: int
    remote_request_id: str


class ZmqConnectorMetadata(msgspec.Struct, array_like=True, omit_defaults=True):
    loads: list[LoadSpec] = []
    sends: list[SendSpec] = []
    releases: list[Release] = []
    cancels: list[str] = []  # loads to drop: the request was aborted meanwhile


_meta_encoder = msgspec.msgpack.Encoder()
_meta_decoder = msgspec.msgpack.Decoder(ZmqConnectorMetadata)
_msg_encoder = msgspec.msgpack.Encoder()
_msg_decoder = msgspec.msgpack.Decoder(dict)


@dataclass
class _Send:
    block_ids: list[int]
    block_set: frozenset[int]
    prompt_hash: str
    deadline: float


def _check_extra(extra: dict[str, Any]) -> dict[str, Any]:
    """The connector's options, checked (``ValueError`` naming the key)."""
    unknown = sorted(k for k in extra if k not in _EXTRA_KEYS)
    if unknown:
        raise ValueError(f"kv_transfer_config.kv_connector_extra_config: unknown key(s) {unknown} for ZmqConnector; "
                         f"known: {list(_EXTRA_KEYS)}")
    host = extra.get("side_channel_host", "127.0.0.1")
    port = extra.get("side_channel_port", 0)
    if not isinstance(host, str) or not host:
        raise ValueError(f"kv_connector_extra_config.side_channel_host must be a host name or address, got {host!r}")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ValueError(f"kv_connector_extra_config.side_channel_port must be a port number 0-65535, got {port!r}")
    out = {"side_channel_host": host, "side_channel_port": port}
    for key, default in (("transfer_timeout", 10.0), ("abort_request_timeout", None)):
        v = extra.get(key, default)
        if v is None:
            v = envs.TINYVLLM_KV_ABORT_REQUEST_TIMEOUT
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"kv_connector_extra_config.{key} must be a number of seconds > 0, got {v!r}")
        out[key] = float(v)
    return out


class ZmqConnector(KVConnectorBase_V1):
    """P/D disaggregation connector (see the module docstring). ``engine_info``: ``block_size``,
    ``fingerprint``, ``engine_id`` and, for the scheduler half, ``side_channel_host`` / ``side_channel_port``
    (what the worker half bound, from :meth:`handshake_info`).

    Raises:
        ValueError: bad ``kv_connector_extra_config``; the side channel cannot be bound.
    """

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, engine_info: dict[str, Any]) -> None:
        super().__init__(config, role, engine_info)
        self.opts = _check_extra(config.kv_connector_extra_config)
        self.block_size: int = engine_info["block_size"]
        self.engine_id: str = engine_info["engine_id"]
        self.fingerprint: str = engine_info.get("fingerprint", "")
        self.produces = config.kv_role in ("kv_producer", "kv_both")
        self.consumes = config.kv_role in ("kv_consumer", "kv_both")
        if role is KVConnectorRole.SCHEDULER:
            self._init_scheduler()
        else:
            self._init_worker()

    # ================================================================== scheduler half
    def _init_scheduler(self) -> None:
        self._step = ZmqConnectorMetadata(loads=[], sends=[], releases=[], cancels=[])
        self._loading: dict[str, LoadSpec] = {}  # request id -> its pull, until the worker reports it
        self._sending: set[str] = set()  # finished requests whose blocks are kept for a pull

    @staticmethod
    def _remote(params: dict[str, Any]) -> tuple[str, int, str] | None:
        host, port, rid = params.get("remote_host"), params.get("remote_port"), params.get("remote_request_id")
        if isinstance(host, str) and isinstance(port, int) and not isinstance(port, bool) and isinstance(rid, str):
            return host, port, rid
        return None

    def _release(self, params: dict[str, Any]) -> None:
        remote = self._remote(params)
        if remote is not None:
            self._step.releases.append(Release(*remote))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        n = request.num_prompt_tokens
        remote = self._remote(params)
        block_ids = params.get("remote_block_ids")
        why = None
        if not self.consumes:
            why = f"kv_role is {self.config.kv_role}"
        elif request.sampling_params.prompt_logprobs is not None:
            why = "prompt logprobs need every prompt position computed here"
        elif remote is None or not isinstance(block_ids, list) or not all(
                isinstance(b, int) and not isinstance(b, bool) for b in block_ids):
            why = "kv_transfer_params lack remote_host / remote_port / remote_request_id / remote_block_ids"
        elif params.get("remote_block_size", self.block_size) != self.block_size:
            why = f"remote block size {params.get('remote_block_size')} != {self.block_size}"
        elif len(block_ids) != -(-n // self.block_size) or request.num_output_tokens:
            why = f"{len(block_ids)} remote blocks for a prompt of {n} tokens"
        elif n - 1 - num_computed_tokens <= 0:
            why = "the local prefix cache already holds the prompt"
        if why is not None:
            params["do_remote_prefill"] = False
            self._release(params)
            logger.info("request %s: not pulling its KV (%s); computing the prompt here", request.request_id, why)
            return 0, False
        return n - 1 - num_computed_tokens, True

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or num_external_tokens <= 0:
            return
        params["do_remote_prefill"] = False  # pulled once; a failure recomputes
        n_load = request.num_prompt_tokens - 1  # KV of these tokens is pulled; the last one is computed here
        first = (n_load - num_external_tokens) // self.block_size
        last = -(-n_load // self.block_size)
        host, port, rid = self._remote(params)  # type: ignore[misc] - checked in get_num_new_matched_tokens
        spec = LoadSpec(request.request_id, list(block_ids[first:last]), list(params["remote_block_ids"][first:last]),
                        host, port, rid, prompt_hash(request.prompt_token_ids))
        self._loading[request.request_id] = spec
        self._step.loads.append(spec)

    def build_connector_meta(self) -> bytes:
        st = self._step
        if not (st.loads or st.sends or st.releases or st.cancels):
            return b""
        self._step = ZmqConnectorMetadata(loads=[], sends=[], releases=[], cancels=[])
        return _meta_encoder.encode(st)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        spec = self._loading.pop(rid, None)
        params = request.kv_transfer_params
        if spec is not None:  # aborted while its blocks were being pulled: drop the pull, free the sender's
            self._step.cancels.append(rid)
            self._step.releases.append(Release(spec.remote_host, spec.remote_port, spec.remote_request_id))
            return False, None
        if not params:
            return False, None
        if params.get("do_remote_prefill"):  # finished before it was admitted: the sender frees at once
            params["do_remote_prefill"] = False
            self._release(params)
            return False, None
        if (not params.get("do_remote_decode") or not self.produces
                or request.status not in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)):
            return False, None
        n = request.num_prompt_tokens
        ids = list(block_ids[:-(-n // self.block_size)])
        if not ids:
            return False, None
        self._step.sends.append(SendSpec(rid, ids, prompt_hash(request.prompt_token_ids)))
        self._sending.add(rid)
        return True, {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
            "remote_request_id": rid, "remote_block_ids": ids,
            "remote_host": self.engine_info["side_channel_host"], "remote_port": self.engine_info["side_channel_port"],
            "tp_size": 1, "remote_block_size": self.block_size, "remote_num_tokens": n,
        }

    def update_connector_output(self, out: KVConnectorOutput) -> None:
        """The worker half's report (vLLM's name): forget what completed."""
        for rid in out.finished_sending:
            self._sending.discard(rid)
        for rid in (*out.finished_recving, *out.failed_recving):
            self._loading.pop(rid, None)

    def has_pending(self) -> bool:
        return bool(self._loading or self._sending or self._step.releases or self._step.cancels)

    # ================================================================== worker half
    def _init_worker(self) -> None:
        self.kv_caches: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self._sends: dict[str, _Send] = {}
        self._gone: OrderedDict[str, None] = OrderedDict()
        # Releases that arrived before their send was registered (a send registers when the step after its
        # request finished binds its metadata; the client may already hold the kv_transfer_params and a fast
        # decode engine release them first): request id -> when to stop waiting for it.
        self._released_early: OrderedDict[str, float] = OrderedDict()
        self._done_sending: list[str] = []
        self._num_expired = 0
        self._loads: dict[str, LoadSpec] = {}
        self._load_started: dict[str, float] = {}
        self._results: queue.Queue = queue.Queue()
        self._jobs: queue.Queue = queue.Queue()
        self._event = threading.Event()
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._meta: ZmqConnectorMetadata | None = None
        self.host = self.opts["side_channel_host"]
        self.port = 0
        self._threads: list[threading.Thread] = []
        if self.produces:
            bound: dict[str, Any] = {}
            ready = threading.Event()
            t = threading.Thread(target=self._serve, args=(bound, ready), name="kv-side-channel", daemon=True)
            t.start()
            ready.wait()
            if "error" in bound:
                raise ValueError(f"kv_transfer_config: cannot bind the KV side channel on "
                                 f"{self.host}:{self.opts['side_channel_port']}: {bound['error']}")
            self.port = bound["port"]
            self._threads.append(t)
            logger.info("KV side channel (ZmqConnector, %s) on tcp://%s:%d, engine id %s", self.config.kv_role,
                        self.host, self.port, self.engine_id)
        if self.consumes:
            t = threading.Thread(target=self._pull_loop, name="kv-puller", daemon=True)
            t.start()
            self._threads.append(t)

    def handshake_info(self) -> dict[str, Any]:
        """What the scheduler half puts in ``kv_transfer_params``: the side channel's host and port."""
        return {"side_channel_host": self.host, "side_channel_port": self.port}

    def bind_connector_metadata(self, metadata: bytes) -> None:
        self._meta = _meta_decoder.decode(metadata) if metadata else None

    def start_load_kv(self) -> None:
        meta = self._meta
        if meta is None:
            return
        for rid in meta.cancels:
            self._loads.pop(rid, None)
        if meta.sends:
            deadline = time.monotonic() + self.opts["abort_request_timeout"]
            with self._lock:
                for s in meta.sends:
                    if self._released_early.pop(s.req_id, None) is not None:  # released already: free at once
                        self._forget(s.req_id)
                        self._done_sending.append(s.req_id)
                        self._event.set()
                        continue
                    self._sends[s.req_id] = _Send(s.block_ids, frozenset(s.block_ids), s.prompt_hash, deadline)
        for spec in meta.loads:
            self._loads[spec.req_id] = spec
            self._load_started[spec.req_id] = time.monotonic()
            self._jobs.put(("pull", spec))
        for rel in meta.releases:
            self._jobs.put(("release", rel))

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        out = KVConnectorOutput()
        for rid in finished_req_ids:
            self._loads.pop(rid, None)
        while True:
            try:
                rid, status, frames, header = self._results.get_nowait()
            except queue.Empty:
                break
            spec = self._loads.pop(rid, None)
            started = self._load_started.pop(rid, None)
            if spec is None:  # cancelled meanwhile: its blocks may belong to another request now
                continue
            if status == "ok":
                try:
                    nbytes = self._write_blocks(spec, frames, header)
                except ValueError as e:
                    status = str(e)
                else:
                    out.finished_recving.append(rid)
                    out.recv_bytes += nbytes
                    out.recv_seconds += time.monotonic() - (started or time.monotonic())
                    continue
            logger.warning("request %s: pulling its KV from %s:%d failed (%s); computing the prompt here", rid,
                           spec.remote_host, spec.remote_port, status)
            out.failed_recving.append(rid)
        if self.produces:
            now = time.monotonic()
            with self._lock:
                while self._released_early and next(iter(self._released_early.values())) <= now:
                    self._released_early.popitem(last=False)  # never registered here (another engine's id)
                for rid in [r for r, s in self._sends.items() if s.deadline <= now]:
                    del self._sends[rid]
                    self._forget(rid)
                    self._done_sending.append(rid)
                    self._num_expired += 1
                    logger.warning("request %s: no decode engine pulled its KV blocks within %.0f s; freed", rid,
                                   self.opts["abort_request_timeout"])
                out.finished_sending, self._done_sending = self._done_sending, []
                out.num_expired, self._num_expired = self._num_expired, 0
        return out

    def clear_connector_metadata(self) -> None:
        self._meta = None

    def wait_for_transfers(self, timeout: float) -> None:
        if self._loads or self._done_sending:
            self._event.wait(timeout)
        self._event.clear()

    def shutdown(self) -> None:
        self._stop.set()
        self._jobs.put(None)
        for t in self._threads:
            t.join(timeout=2)
        self._ctx.term()

    # ------------------------------------------------------------------ block bytes
    def _write_blocks(self, spec: LoadSpec, frames: list, header: dict) -> int:
        """Check the pulled frames against this engine's KV tensors, then copy them into ``spec``'s blocks.
        Returns the bytes written. Raises ``ValueError`` (nothing written) on any mismatch."""
        n = len(spec.local_block_ids)
        if header.get("fingerprint") != self.fingerprint:
            raise ValueError(f"the prefill engine runs another model or KV layout ({header.get('fingerprint')!r}, "
                             f"here {self.fingerprint!r})")
        if len(frames) != len(self.kv_caches):
            raise ValueError(f"{len(frames)} KV tensors received, {len(self.kv_caches)} expected")
        views = []
        for t, frame in zip(self.kv_caches, frames):
            shape = (t.shape[0], n, *t.shape[2:])
            nbytes = math.prod(shape) * t.element_size()
            buf = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
            if buf.nbytes != nbytes:
                raise ValueError(f"a KV tensor of {buf.nbytes} bytes received, {nbytes} expected")
            with warnings.catch_warnings():  # a received frame is read-only; it is only read
                warnings.simplefilter("ignore")
                views.append(torch.frombuffer(buf, dtype=t.dtype).view(shape))
        idx = torch.tensor(spec.local_block_ids, dtype=torch.int64, device=self.kv_caches[0].device)
        total = 0
        for t, v in zip(self.kv_caches, views):
            t.index_copy_(1, idx, v.to(t.device))
            total += v.numel() * v.element_size()
        return total

    def _gather(self, block_ids: list[int]) -> list:
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.kv_caches[0].device)
        out = []
        for t in self.kv_caches:
            b = t.index_select(1, idx).cpu().contiguous()
            out.append(b.view(torch.uint8).numpy() if b.dtype != torch.uint8 else b.numpy())
        return out

    def _forget(self, rid: str) -> None:
        self._gone[rid] = None
        while len(self._gone) > _GONE_MEMORY:
            self._gone.popitem(last=False)

    # ------------------------------------------------------------------ prefill side: the side channel
    def _serve(self, bound: dict, ready: threading.Event) -> None:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            port = self.opts["side_channel_port"]
            if port:
                sock.bind(f"tcp://{self.host}:{port}")
                bound["port"] = port
            else:
                bound["port"] = sock.bind_to_random_port(f"tcp://{self.host}")
        except zmq.ZMQError as e:
            bound["error"] = str(e)
            sock.close()
            ready.set()
            return
        ready.set()
        try:
            while not self._stop.is_set():
                if not sock.poll(100):
                    continue
                frames = sock.recv_multipart()
                try:
                    msg = _msg_decoder.decode(frames[-1])
                    reply = self._handle(msg)
                except Exception as e:  # noqa: BLE001 - a bad message must not stop the side channel
                    logger.warning("KV side channel: bad message (%s: %s)", type(e).__name__, e)
                    reply = None
                if reply is not None:
                    sock.send_multipart([frames[0], b"", *reply], copy=False)
        finally:
            sock.close()

    def _handle(self, msg: dict) -> list | None:
        op, rid = msg.get("op"), msg.get("req")
        if op == "release":
            with self._lock:
                if self._sends.pop(rid, None) is not None:
                    self._forget(rid)
                    self._done_sending.append(rid)
                    self._event.set()
                elif isinstance(rid, str) and rid not in self._gone:  # not registered yet: free it when it is
                    self._released_early[rid] = time.monotonic() + self.opts["abort_request_timeout"]
                    while len(self._released_early) > _GONE_MEMORY:
                        self._released_early.popitem(last=False)
            return None
        if op != "pull":
            return None
        payload: list = []
        with self._lock:
            st = self._sends.get(rid)
            if st is None:
                status = "gone (already pulled, released or expired)" if rid in self._gone else "unknown"
            elif msg.get("fingerprint") != self.fingerprint:
                status = f"another model or KV layout ({msg.get('fingerprint')!r}, here {self.fingerprint!r})"
            elif msg.get("prompt_hash") != st.prompt_hash:
                status = "another prompt"
            elif not msg.get("blocks") or not set(msg["blocks"]) <= st.block_set:
                status = "blocks not of this request"
            else:
                payload = self._gather(msg["blocks"])
                status = "ok"
            if st is not None and status != "unknown":  # served, or refused for good: free the blocks
                del self._sends[rid]
                self._forget(rid)
                self._done_sending.append(rid)
                self._event.set()
        header = {"req": rid, "status": status, "fingerprint": self.fingerprint, "engine_id": self.engine_id}
        return [_msg_encoder.encode(header), *payload]

    # ------------------------------------------------------------------ decode side: the puller
    def _pull_loop(self) -> None:
        socks: dict[tuple[str, int], zmq.Socket] = {}

        def sock_for(host: str, port: int) -> zmq.Socket:
            s = socks.get((host, port))
            if s is None:
                s = socks[(host, port)] = self._ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.connect(f"tcp://{host}:{port}")
            return s

        def drop(host: str, port: int) -> None:
            s = socks.pop((host, port), None)
            if s is not None:
                s.close(0)

        try:
            while not self._stop.is_set():
                job = self._jobs.get()
                if job is None:
                    break
                kind, spec = job
                try:
                    if kind == "release":
                        sock_for(spec.host, spec.port).send_multipart(
                            [b"", _msg_encoder.encode({"op": "release", "req": spec.remote_request_id})],
                            flags=zmq.NOBLOCK)
                        continue
                    result = self._pull(spec, sock_for)
                except (zmq.ZMQError, msgspec.DecodeError, OSError) as e:
                    drop(spec.host if kind == "release" else spec.remote_host,
                         spec.port if kind == "release" else spec.remote_port)
                    result = ("error: " + str(e), [], {})
                    if kind == "release":
                        continue
                if result[0].startswith("timeout"):
                    drop(spec.remote_host, spec.remote_port)  # late replies must not meet the next pull
                self._results.put((spec.req_id, *result))
                self._event.set()
        finally:
            for s in socks.values():
                s.close(0)

    def _pull(self, spec: LoadSpec, sock_for: Any) -> tuple[str, list, dict]:
        sock = sock_for(spec.remote_host, spec.remote_port)
        msg = _msg_encoder.encode({"op": "pull", "req": spec.remote_request_id, "blocks": spec.remote_block_ids,
                                   "prompt_hash": spec.prompt_hash, "fingerprint": self.fingerprint})
        deadline = time.monotonic() + self.opts["transfer_timeout"]
        sock.send_multipart([b"", msg])
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(max(1, int(left * 1000))):
                return f"timeout: no answer within {self.opts['transfer_timeout']:g} s", [], {}
            frames = sock.recv_multipart(copy=False)
            header = _msg_decoder.decode(frames[1].bytes)
            if header.get("req") != spec.remote_request_id:
                continue  # a late answer to an earlier pull
            status = header.get("status")
            if status == "unknown":  # not registered yet (or a restarted engine): ask again until the deadline
                time.sleep(_UNKNOWN_RETRY_S)
                sock.send_multipart([b"", msg])
                continue
            return status, list(frames[2:]), header
