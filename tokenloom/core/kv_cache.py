"""Paged KV cache bookkeeping: the block pool and per-request block tables.

The seed: "KV Cache 中已经存了 7 个 token 的 K / V" and then grows by one entry per
decode step.  Here the cache is cut into fixed-size blocks (`block_size` tokens).  A
request owns a *block table* (list of block ids); token i of the request lives in
block `table[i // block_size]`, offset `i % block_size`.  Growing by one token only
needs a new block every `block_size` steps, and memory is never fragmented.

Prefix caching: a *full* block is named by a key: a SHA-256 digest chained over
(parent block key, its token ids), where the first block's parent is a root digest of
the request's extra keys (its `cache_salt` and its LoRA adapter).  One key therefore names the whole token
prefix up to the end of its block, so a lookup by key alone is exact: serving another
prompt's KV would need a SHA-256 collision, not merely equal Python `hash()` values
(which collide on demand: `hash(-1) == hash(-2)`, and are per-process under hash
randomisation of strings).  A new request whose prompt starts with the same tokens
finds those blocks by key and skips computing them.  Freed blocks keep their key and
stay findable until the pool needs them; the least recently freed block is evicted
first.  Blocks are reference counted, so many requests can read one block; nobody
writes into a full block, so sharing is safe.

Beam search forks: a beam that continues another's sequence takes that beam's whole
block table (`fork`: every block one more reference), partly filled last block included.
The first time either writes into a block that is still shared, that block is copied
(copy-on-write): `allocate` gives the writer a fresh block and records (source, copy) in
`pending_copies`; the scheduler hands the list to the runner, which copies the K/V of
those blocks before the step's forward pass writes anything.

    beam 0: [b0][b2*]        beam 1 forks beam 0: [b0][b2*]   (b0, b2 ref_cnt 2)
    beam 1 writes token 21 -> b2 is shared: beam 1 gets b5, copy b2 -> b5, b2 ref_cnt 1

Pure Python: no torch here.  The model runner owns the tensors; this module only
decides which block ids hold which tokens (the simulator runs it unchanged).

    pool:   [b0][b1][b2][b3][b4][b5] ...        free queue (LRU first): b4 -> b1 -> b5
    req A:  table [b0, b2]    tokens 0..15 in b0, 16..20 in b2
    req B:  table [b0, b3]    shares b0 (same 16-token prefix, ref_cnt 2)
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from tokenloom.request import Request


BlockKey = bytes
"""A full block's prefix-cache key: a SHA-256 digest of everything up to its end."""

_KEY_DOMAIN = b"tokenloom-prefix-block-v1"


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockKey | None = None  # set once the block is full and computed


def root_key(cache_salt: str | None, regime: int = 0, lora_int_id: int = 0) -> BlockKey:
    """The parent key of a request's first block: a digest of its extra keys.

    Requests with different salts get unrelated chains, so they never share a block;
    no salt and the empty salt are kept apart by a one-byte tag.  `regime` (non-zero: a
    request long enough for the model's long-context rotation, whose K/V differ for the
    same tokens) comes first under its own tag, so no salt can imitate it.  So does the
    request's LoRA adapter (`lora_int_id`, 0: the base model): the same tokens under
    another adapter have other K/V, every layer's projections differ.  The base model's
    keys are those of an engine without LoRA."""
    h = hashlib.sha256(_KEY_DOMAIN)
    if regime:
        h.update(b"\x02" + regime.to_bytes(4, "little"))
    if lora_int_id:
        h.update(b"\x03" + lora_int_id.to_bytes(8, "little", signed=True))
    if cache_salt is not None:
        h.update(b"\x01" + cache_salt.encode("utf-8", "surrogatepass"))
    return h.digest()


def hash_block(parent_key: BlockKey, token_ids: list[int] | tuple[int, ...]) -> BlockKey:
    """Chained block key: SHA-256 over the parent's key and the block's token ids.

    The parent key has a fixed length and the ids are packed as fixed-width signed
    64-bit integers, so the byte string is unambiguous; hashing one block costs one
    small array and one digest of (32 + 8 * block_size) bytes."""
    h = hashlib.sha256(parent_key)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockPool:
    """Fixed set of KV blocks with ref counts, an LRU free queue and a prefix-key index."""

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Insertion order == eviction order: the least recently freed block goes first.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[BlockKey, KVBlock] = {}
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def usage(self) -> float:
        return self.num_used / self.num_blocks

    def allocate(self, n: int) -> list[KVBlock]:
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} KV blocks with only {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            bid, _ = self.free_queue.popitem(last=False)
            blk = self.blocks[bid]
            if blk.block_hash is not None:  # evict: its cached content is about to be overwritten
                if self.cached.get(blk.block_hash) is blk:
                    del self.cached[blk.block_hash]
                blk.block_hash = None
                self.num_evictions += 1
            blk.ref_cnt = 1
            out.append(blk)
        return out

    def touch(self, blk: KVBlock) -> None:
        """Take one more reference (a prefix-cache hit); revives a free cached block."""
        if blk.ref_cnt == 0:
            del self.free_queue[blk.block_id]
        blk.ref_cnt += 1

    def release(self, blk: KVBlock) -> None:
        blk.ref_cnt -= 1
        if blk.ref_cnt < 0:
            raise RuntimeError(f"KV block {blk.block_id} released more often than taken")
        if blk.ref_cnt == 0:
            if self.enable_caching and blk.block_hash is not None:
                self.free_queue[blk.block_id] = None  # stays findable until evicted
            else:
                blk.block_hash = None
                self.free_queue[blk.block_id] = None

    def lookup(self, key: BlockKey) -> KVBlock | None:
        """The cached block whose whole prefix digests to key, if any.

        The key already covers the block's tokens and every block before it (and the
        salt), so no per-block token check is needed, nor would one be enough."""
        return self.cached.get(key)

    def register(self, blk: KVBlock, key: BlockKey) -> None:
        """Publish a freshly filled block under its key (first writer wins)."""
        if not self.enable_caching or blk.block_hash is not None:
            return
        if key in self.cached:
            return  # an identical block already exists (computed twice in one step); keep that one
        blk.block_hash = key
        self.cached[key] = blk


@dataclass
class PrefixHit:
    blocks: list[KVBlock] = field(default_factory=list)

    def num_tokens(self, block_size: int) -> int:
        return len(self.blocks) * block_size


class KVCacheManager:
    """Per-request block tables on top of a BlockPool."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 regime_split: int | None = None):
        """`regime_split`: requests longer than this many tokens key their blocks apart from
        shorter ones (the model rotates them differently: `SchedulerConfig.recompute_past`)."""
        if block_size < 1:
            raise ValueError("--block-size must be >= 1")
        self.block_size = block_size
        self.regime_split = regime_split
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.tables: dict[str, list[KVBlock]] = {}
        self.table_ids: dict[str, list[int]] = {}  # same tables as plain ids, for the runner
        self._num_published: dict[str, int] = {}  # leading blocks already offered to the cache
        # prefix-cache statistics, in tokens (what /metrics exports)
        self.prefix_queries = 0
        self.prefix_hits = 0
        # copy-on-write: (source block id, copy block id) recorded since the scheduler last
        # took them (`take_copies`); the runner copies them before the step's forward pass
        self.pending_copies: list[tuple[int, int]] = []
        self.num_forks = 0  # beam forks so far: until the first, no block is shared by writers
        self.num_copies = 0  # blocks copied on write so far

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (a live list: read it, don't keep it across steps)."""
        return self.table_ids.get(request_id, [])

    # ---- prefix caching ---------------------------------------------
    def _extend_hashes(self, req: Request, num_tokens: int) -> None:
        """Make sure req.block_hashes covers every full block among its first num_tokens."""
        bs = self.block_size
        full = num_tokens // bs
        while len(req.block_hashes) < full:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if req.block_hashes else root_key(req.cache_salt, self._regime(req),
                                                                            req.lora_int_id)
            req.block_hashes.append(hash_block(parent, req.token_slice(i * bs, (i + 1) * bs)))

    def _regime(self, req: Request) -> int:
        return int(self.regime_split is not None and req.num_tokens > self.regime_split)

    def find_cached_prefix(self, req: Request) -> PrefixHit:
        """Longest run of cached full blocks from the start of req's tokens.

        At most num_tokens - 1 tokens may hit: the last token is always computed so
        the step produces logits to sample from."""
        if (not self.enable_prefix_caching or req.sampling_params.prompt_logprobs is not None
                or req.pooling is not None):
            return PrefixHit()  # prompt logprobs and pooling need every prompt position computed
        bs = self.block_size
        max_blocks = (req.num_tokens - 1) // bs
        self._extend_hashes(req, max_blocks * bs)
        hit = PrefixHit()
        for i in range(max_blocks):
            blk = self.pool.lookup(req.block_hashes[i])
            if blk is None:
                break
            hit.blocks.append(blk)
        return hit

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_query_tokens
        self.prefix_hits += num_hit_tokens

    # ---- allocation -------------------------------------------------
    def can_allocate(self, req: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        return self._blocks_needed(req, num_new_tokens, hit) <= self._free_after_touch(hit)

    def _blocks_needed(self, req: Request, num_new_tokens: int, hit: PrefixHit | None) -> int:
        have = len(self.tables.get(req.request_id, ())) + (len(hit.blocks) if hit else 0)
        total_tokens = req.num_computed_tokens + num_new_tokens
        return max(0, -(-total_tokens // self.block_size) - have)

    def _free_after_touch(self, hit: PrefixHit | None) -> int:
        # A cache hit on a free block takes it out of the free queue.
        revived = sum(1 for b in hit.blocks if b.ref_cnt == 0) if hit else 0
        return self.pool.num_free - revived

    def allocate(self, req: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Reserve room for num_new_tokens more tokens of req (after its computed ones).

        With a prefix hit (first admission), the hit blocks are adopted first.
        Returns False, changing nothing, if the pool is too small right now."""
        shared = self._shared_writes(req, num_new_tokens)
        if hit is None and not shared:  # the decode fast path: most steps need no new block
            ids = self.table_ids.get(req.request_id)
            if ids is not None and req.num_computed_tokens + num_new_tokens <= len(ids) * self.block_size:
                return True
        need = self._blocks_needed(req, num_new_tokens, hit)
        if need + len(shared) > self._free_after_touch(hit):
            return False
        table = self.tables.setdefault(req.request_id, [])
        ids = self.table_ids.setdefault(req.request_id, [])
        for i in shared:  # copy-on-write: the writer gets its own copy of a shared block
            (copy,) = self.pool.allocate(1)
            self.pending_copies.append((table[i].block_id, copy.block_id))
            self.num_copies += 1
            self.pool.release(table[i])
            table[i] = copy
            ids[i] = copy.block_id
        new: list[KVBlock] = []
        if hit:
            for b in hit.blocks:
                self.pool.touch(b)
            new.extend(hit.blocks)
            # adopted blocks are already published
            self._num_published[req.request_id] = len(table) + len(hit.blocks)
        if need:
            new.extend(self.pool.allocate(need))
        table.extend(new)
        ids.extend(b.block_id for b in new)
        return True

    def _shared_writes(self, req: Request, num_new_tokens: int) -> list[int]:
        """Indices in req's table of the blocks its next `num_new_tokens` tokens write into
        that another request also holds (a forked beam's partly filled last block)."""
        table = self.tables.get(req.request_id) if self.num_forks else None
        if not table:
            return []
        bs = self.block_size
        first = req.num_computed_tokens // bs
        last = min((req.num_computed_tokens + num_new_tokens - 1) // bs, len(table) - 1)
        return [i for i in range(first, last + 1) if table[i].ref_cnt > 1]

    def fork(self, pairs: list[tuple[Request, Request]]) -> None:
        """Beam search: each (child, parent) -- the child's block table becomes the parent's
        (every block one more reference; shared blocks are copied when written, see
        `allocate`), and the child's old blocks are released.  All parents' tables are read
        before any is replaced, so a beam may be both a parent and a child."""
        new = [(child, list(self.tables.get(parent.request_id, ())),
                self._num_published.get(parent.request_id, 0)) for child, parent in pairs]
        self.num_forks += len(pairs)
        for _, table, _ in new:
            for blk in table:
                self.pool.touch(blk)
        for child, table, published in new:
            old = self.tables.get(child.request_id, [])
            for blk in reversed(old):
                self.pool.release(blk)
            self.tables[child.request_id] = table
            self.table_ids[child.request_id] = [b.block_id for b in table]
            self._num_published[child.request_id] = published

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write copies recorded since the last call, in order (then forgotten)."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def cache_full_blocks(self, req: Request) -> None:
        """After a step: publish every block that is now full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        table = self.tables.get(req.request_id)
        if not table:
            return
        bs = self.block_size
        full = min(req.num_computed_tokens // bs, len(table))
        done = self._num_published.get(req.request_id, 0)
        if full <= done:  # the common decode step: no block filled up
            return
        self._extend_hashes(req, full * bs)
        for i in range(done, full):
            blk = table[i]
            if blk.block_hash is None:
                self.pool.register(blk, req.block_hashes[i])
        self._num_published[req.request_id] = full

    def trim(self, req: Request, num_tokens: int) -> None:
        """Give back the blocks past the first num_tokens tokens of req (speculative decoding:
        slots reserved for drafts the model rejected).  Those blocks hold no computed token
        yet, so none was published to the prefix cache; the freshly freed go to the end of the
        free queue, the ones evicted last."""
        table = self.tables.get(req.request_id)
        if not table:
            return
        keep = -(-num_tokens // self.block_size)
        if keep >= len(table):
            return
        ids = self.table_ids[req.request_id]
        while len(table) > keep:
            blk = table.pop()
            ids.pop()
            self.pool.release(blk)

    def free(self, req: Request) -> None:
        """Return req's blocks.  Tail blocks are freed first so they are evicted first:
        a later request is likelier to share a prompt's head than its tail."""
        table = self.tables.pop(req.request_id, None)
        self.table_ids.pop(req.request_id, None)
        self._num_published.pop(req.request_id, None)
        if not table:
            return
        for blk in reversed(table):
            self.pool.release(blk)
