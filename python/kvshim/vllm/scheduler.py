"""The scheduler side of the connector (vLLM's scheduler process, one per
engine): vLLM's requests as the native scheduler's arguments."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

try:  # vLLM 0.33 (0.32 has no per-tier hit sources: the hook is then never called)
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # pragma: no cover - older vLLM
    CacheHitSource = None  # type: ignore[assignment,misc]
from vllm.v1.request import RequestStatus

from kvshim import events as kv_events
from kvshim import native
from kvshim.errors import InvalidArgumentError, KVShimError, NotSupportedError
from kvshim.vllm.config import logger
from kvshim.vllm.stats import KVShimMetadata, KVShimStats

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


def _flat_groups(block_ids: Any) -> tuple[list[int], int]:
    """vLLM's per-group block ids (a tuple of lists) in kvshim.h's one form:
    the groups one after the other, each padded with -1 to the longest, and
    their count."""
    if len(block_ids) == 1:
        return list(block_ids[0]), 1
    n = max(len(ids) for ids in block_ids)
    out: list[int] = []
    for ids in block_ids:
        out.extend(ids)
        out.extend([-1] * (n - len(ids)))
    return out, len(block_ids)


class KVShimScheduler:
    """The scheduler side of the connector (vLLM's scheduler process, one per
    engine): vLLM's requests as the native scheduler's arguments."""

    def __init__(self, sched: native.Scheduler, chunk_size: int, sync_load: bool = False) -> None:
        self.native = sched
        self._chunk = chunk_size
        # Synchronous loads (kvshim.sync_load, kvshim.layerwise): vLLM schedules
        # the request in the step that loads it; its forward pass waits for it.
        self._async = not sync_load
        self._ids: dict[str, list[int]] = {}  # request -> the ids it is looked up over
        # rid -> [request, tokens Go keyed (a chunk boundary), num_preemptions when keyed]
        self._decoding: dict[str, list[Any]] = {}
        self._match_errors = 0
        self._delay_freed: set[str] = set()  # finished, blocks kept until finished_sending
        self.events: kv_events.EventSource | None = None  # with --kv-events-config (kvshim/events.py)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        rid = request.request_id
        if self.events is not None:
            self.events.track(request)  # its block hashes name the blocks of its saves
        ids = self._ids.get(rid)
        dec = self._decoding.get(rid)
        if ids is None:
            self._request_options(request)
        if ids is None or (dec is not None and dec[2] != request.num_preemptions):
            # Once per request, and once more each time it is resumed after a
            # preemption: vLLM asks again while a lookup is pending. A resumed
            # request is looked up over all its tokens, prompt and generated:
            # the chunks saved during its decode are loads, not recompute.
            embeds = getattr(request, "prompt_embeds", None) is not None
            seq = request.prompt_token_ids if embeds else self._lookup_ids(request)
            # Only vLLM's prompt list goes to the library as it is: it never
            # changes. all_token_ids (a preempted request's) is a view of a
            # list that grows as the request decodes: its ids now.
            ids = seq if type(seq) is list and seq is request.prompt_token_ids else list(seq or ())
            self._ids[rid] = ids
            if not embeds:
                self._decoding[rid] = [request, len(ids) // self._chunk * self._chunk, request.num_preemptions]
        try:
            n = self._match(rid, ids, _extras(request), num_computed_tokens)
        except (KVShimError, ValueError, TypeError) as e:  # ValueError, TypeError: an id that is no uint32
            return self._miss(rid, e)
        if n is None:
            return None, False  # pending: vLLM asks again next step
        return n, n > 0 and self._async

    def _match(self, rid: str, ids: list[int], extras: dict[str, Any] | None, num_computed: int) -> int | None:
        """native.match over the request's ids: the list goes to the library
        as it is (match_list, which reads it only while Go has not keyed the
        request); one the library cannot read is converted by Python."""
        try:
            return self.native.match_list(rid, ids, extras, num_computed)
        except (NotSupportedError, InvalidArgumentError):
            # An id that is no uint32 (native.token_ids names it), or a
            # library or process that cannot read Python lists.
            return self.native.match(rid, ids, extras, num_computed)

    def _request_options(self, request: Request) -> None:
        """The request's kvshim.* kv_transfer_params (docs/vllm-controls.md),
        checked by Go. A bad key or value never fails the request or the
        engine: it is logged, and the request is served without kvshim
        (neither loaded nor saved: a misspelt skip_save must not save)."""
        params = getattr(request, "kv_transfer_params", None)
        if not params or not any(isinstance(k, str) and k.startswith("kvshim.") for k in params):
            return
        try:
            self.native.request_options(request.request_id, params)
        except KVShimError as e:
            logger.warning("kvshim: request %s: %s", request.request_id, e)

    def reset(self) -> bool:
        """reset_cache: True once the server moved the deployment to a new
        generation (nothing stored before is found in any tier)."""
        try:
            gen = self.native.reset()
        except KVShimError as e:
            logger.warning("kvshim: reset_cache failed, the cache was not reset: %s", e)
            return False
        logger.info("kvshim: cache reset (generation %d)", gen)
        return True

    def hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """get_external_cache_hit_sources, per chunk from the tier that served it."""
        if num_external_tokens <= 0:
            return {}
        try:
            got = self.native.hit_sources(request.request_id, num_external_tokens)
        except KVShimError:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        return {CacheHitSource(k): v for k, v in got.items() if v}

    @staticmethod
    def _lookup_ids(request: Request) -> Any:
        """Its prompt, or all its tokens once preempted (it recomputes its answer too)."""
        return request.all_token_ids if request.num_preemptions else request.prompt_token_ids

    def _miss(self, rid: str, why: Exception) -> tuple[int, bool]:
        """A request kvshim cannot key (a token id outside uint32, a LoRA
        path past the length limit, a malformed input) is computed by vLLM: a
        miss, never a dead scheduler; nor saved at its end. Logged at most a
        few times, then sparsely."""
        if isinstance(why, (ValueError, TypeError)):  # InvalidArgumentError too: unkeyable, not a dead server
            self._ids.pop(rid, None)
        self._match_errors += 1
        if self._match_errors <= 10 or self._match_errors % 1000 == 0:
            logger.warning("kvshim: request %s is a miss (%d so far): %s", rid, self._match_errors, why)
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        # num_computed left out: Go uses the local prefix-cache hit it was given at the match.
        ids, groups = _flat_groups(blocks.get_block_ids())
        self.native.after_alloc(request.request_id, ids, num_external_tokens, groups=groups)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVShimMetadata:
        sched = scheduler_output.num_scheduled_tokens
        reqs: list[native.StepRequest] = []
        for r in scheduler_output.scheduled_new_reqs:
            ids, groups = _flat_groups(r.block_ids)
            reqs.append({"req": r.req_id, "blocks": ids, "groups": groups, "computed": r.num_computed_tokens,
                         "scheduled": sched.get(r.req_id, 0)})
        cached = scheduler_output.scheduled_cached_reqs
        resumed: set[str] = getattr(cached, "resumed_req_ids", set()) or set()
        for i, rid in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            ids, groups = _flat_groups(new) if new is not None else ([], 1)
            entry: native.StepRequest = {"req": rid, "computed": cached.num_computed_tokens[i],
                                         "scheduled": sched.get(rid, 0), "groups": groups}
            if rid in resumed:
                entry["blocks"] = ids
            else:
                entry["new_blocks"] = ids
                if rid in self._decoding:
                    self._decoded_chunks(rid, entry)
            reqs.append(entry)
        step: native.Step = {"requests": reqs, "preempted": sorted(scheduler_output.preempted_req_ids or ())}
        return KVShimMetadata(self.native.build_meta(step))

    def _decoded_chunks(self, rid: str, entry: native.StepRequest) -> None:
        """A running request whose KV crossed a chunk boundary since Go
        keyed its tokens: its token ids up to the last boundary go with its
        step entry (Go keys and saves the new full chunks). Only tokens
        whose KV is computed, accepted and processed count: vLLM's
        num_computed_tokens less the tokens in flight (rejected draft tokens
        are already rolled back; the last sampled token has no KV yet)."""
        dec = self._decoding[rid]
        request, keyed = dec[0], dec[1]
        done = request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0)
        if done < keyed + self._chunk:
            return
        end = done // self._chunk * self._chunk
        try:
            tokens = native.token_ids(request.all_token_ids[keyed:end]).tolist()  # type: ignore[union-attr]
        except (ValueError, TypeError):  # an id that is no uint32: not saved
            return
        if len(tokens) == end - keyed:
            entry["tokens"], entry["tokens_from"] = tokens, keyed
            dec[1] = end

    def has_pending_block_frees(self) -> bool:
        # Blocks of finished requests come back once their saves have read
        # them (finished_sending): vLLM waits for those instead of
        # preempting a running request (Scheduler.schedule).
        return bool(self._delay_freed)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._delay_freed.difference_update(connector_output.finished_sending or ())
        if self.events is not None:  # the workers' save reports: what was committed
            self.events.reports(getattr(connector_output, "kv_connector_worker_meta", None))
        if connector_output.finished_recving:
            # A request aborted before vLLM saw its load finish is a cancelled load (its trace record).
            self.native.received(sorted(connector_output.finished_recving))

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        delay = self._finish(request, block_ids)
        if delay:
            self._delay_freed.add(request.request_id)
        return delay, None

    def _finish(self, request: Request, block_ids: tuple[list[int], ...]) -> bool:
        """Tells the native scheduler the request finished; whether vLLM
        must keep its blocks until finished_sending."""
        rid = request.request_id
        prompt = self._ids.pop(rid, None)
        self._decoding.pop(rid, None)
        if prompt is None or request.status not in _SAVED_AT_FINISH or getattr(request, "prompt_embeds", None) is not None:
            # Never looked up, aborted (or failed), or a prompt of embeddings
            # (its token ids are placeholders): nothing new is saved.
            return self.native.finished(rid)
        # Every full chunk it computed, prompt and answer, is saved (the next
        # turn of a conversation hits its answer too); Go keyed the prompt's
        # full chunks at the lookup. Computed: num_computed_tokens less the
        # tokens of steps in flight (async scheduling), as vLLM caches its own.
        first = len(prompt) // self._chunk * self._chunk
        computed = request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0)
        ids, groups = _flat_groups(block_ids)
        done = self.native.finished_tokens(rid, request.all_token_ids[first:], first, computed, ids, groups)
        if done.not_saved is not None:
            # The request is finished either way: tokens that do not fit it
            # skip the save, never an error in vLLM's scheduler.
            logger.warning("kvshim: the computed chunks of request %s are not saved: %s", rid, done.not_saved)
        return done.delay

    def get_stats(self) -> KVShimStats | None:
        """The scheduler's part of the stats (hit_tokens, hit_requests):
        vLLM calls this after every step's update_from_output and adds it
        to the workers' stats."""
        st = KVShimStats(data=self.native.take_step_stats())
        return None if st.is_empty() else st

    def stats(self) -> native.SchedulerStats:
        return self.native.stats()

    def shutdown(self) -> None:
        self.native.close()


# A request saves its computed chunks at request_finished only if it finished
# normally (an aborted or failed one saves nothing new).
_SAVED_AT_FINISH = frozenset(s for s in RequestStatus if s.name in ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED",
                                                                    "FINISHED_REPETITION"))


def _extras(request: Request) -> dict[str, Any] | None:
    """The request's inputs that change its KV besides the tokens, each with
    its structure, as shim.DecodeExtras reads them (None: none). The LoRA is
    {name, path}, vLLM's own prefix-cache identity of an adapter
    (kv_cache_utils._gen_lora_extra_hash_keys); lora_int_id, a slot in this
    process's LoRA manager, differs across engines (shim.LoRA)."""
    ex: dict[str, Any] = {}
    if getattr(request, "cache_salt", None):
        ex["cache_salt"] = request.cache_salt
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        ex["lora"] = {"name": lora.lora_name, "path": getattr(lora, "lora_path", "")}
    mm = []
    for f in getattr(request, "mm_features", None) or ():
        pos = f.mm_position
        mm.append({"hash": str(f.identifier), "offset": int(pos.offset), "length": int(pos.length)})
    if mm:
        ex["mm"] = mm
    return ex or None
