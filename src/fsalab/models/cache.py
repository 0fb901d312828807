"""A transformers ``Cache`` holding one ``NSADecodeCache`` per NSA decoder layer (DESIGN §9).

``model.generate(input_ids, past_key_values=NSAModelCache(model, capacity), ...)`` runs a
patched model (``patch.patch_model``) through Hugging Face's cache API: the first forward (the
prompt, one unpadded sequence per batch row) fills each layer's cache from the packed prefill,
every later forward brings one token per row and runs the NSA decode step. HF's own layers'
``update`` is never called: the adapter reads and appends to ``layers[i].nsa`` itself.

The sequence length that HF asks for (``get_seq_length``, ``get_mask_sizes``) is a host int
counted from the forwards' shapes, so nothing reads the device lengths back.

On CUDA each layer's decode step (projections, the NSA step, output projection) is replayed from
a CUDA graph (``DecodeGraph``; ``cuda_graphs=False`` keeps it eager): HF's generate loop is
host-bound at batch 1, and one replay replaces the step's dozen launches and their Python glue.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from transformers.cache_utils import Cache, CacheLayerMixin

from ..ops.decode import NSADecodeCache


class DecodeGraph:
    """One decoder layer's decode step replayed from a CUDA graph.

    ``graph(step, x)`` returns ``step(x)``. The first call runs eagerly (Triton compiles and tunes
    outside any capture); the second records ``step`` into a graph and replays it; later calls
    copy x into the recorded input and replay. The capture runs on a side stream into ``pool``
    (shared by a model's layers, which replay in the order they were recorded) and skips
    ``torch.cuda.graph``'s device synchronisation and cache emptying, which would cost a
    generate call more than its graphs save. ``step`` must keep its shapes, tensors and host
    state from call to call and read no device value on the host: the NSA decode step (the
    cache's tensors are fixed at the prefill; its lengths live on the device). The output is
    a copy, so a later replay does not overwrite what the caller holds.
    """

    def __init__(self, pool) -> None:
        self.pool = pool
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.x: torch.Tensor | None = None
        self.out: torch.Tensor | None = None

    def __call__(self, step, x: torch.Tensor) -> torch.Tensor:
        if self.graph is None:
            self.calls += 1
            if self.calls == 1:
                return step(x)
            self._record(step, x)
        else:
            self.x.copy_(x)
        self.graph.replay()
        return self.out.clone()

    def _record(self, step, x: torch.Tensor) -> None:
        self.x = x.clone()
        graph = torch.cuda.CUDAGraph()
        here = torch.cuda.current_stream(x.device)
        side = torch.cuda.Stream(x.device)
        side.wait_stream(here)
        with torch.cuda.stream(side):
            graph.capture_begin(pool=self.pool)
            try:
                self.out = step(self.x)
            finally:
                graph.capture_end()
        here.wait_stream(side)
        self.graph = graph


class NSACacheLayer(CacheLayerMixin):
    """One decoder layer's NSA decode cache, allocated at the prefill (``nsa``), the tokens seen
    so far (``seen``, host int) and, with CUDA graphs, the layer's ``DecodeGraph`` (``graph``,
    made at the prefill with the cache it reads)."""

    is_compileable = False
    is_sliding = False

    def __init__(self, capacity: int, graph_pool=None) -> None:
        super().__init__()
        self.capacity = capacity
        self.nsa: NSADecodeCache | None = None
        self.seen = 0
        self.graph_pool = graph_pool
        self.graph: DecodeGraph | None = None

    def start(self, nsa: NSADecodeCache, prompt_length: int) -> None:
        """The prefill's cache (filled by the prefill that follows) and its prompt length."""
        self.nsa, self.seen = nsa, prompt_length
        self.graph = DecodeGraph(self.graph_pool) if self.graph_pool is not None else None

    def lazy_initialization(self, *args, **kwargs) -> None:
        """Nothing to do: the NSA adapter allocates ``nsa`` at the prefill."""

    def update(self, *args, **kwargs):
        raise TypeError("NSAModelCache layers are filled by fsalab's NSA adapter, not by HF attention: "
                        "patch the model with fsalab.models.patch_model first")

    def get_seq_length(self, *args) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return self.capacity

    def get_max_cache_shape(self) -> int:
        return self.capacity

    def get_mask_sizes(self, query, *args) -> tuple[int, int]:
        """(kv_length, kv_offset) for HF's mask builder; ``query`` is the query length (an int) or,
        in older transformers, the cache positions (a tensor)."""
        query_length = query if isinstance(query, int) else query.shape[0]
        return self.seen + query_length, 0

    def reset(self) -> None:
        self.nsa, self.seen, self.graph = None, 0, None


class NSAModelCache(Cache):
    """One ``NSACacheLayer`` per decoder layer of ``model``; ``capacity``: tokens per sequence
    (prompt plus generated), fixed at construction so every step has static shapes.
    ``cuda_graphs``: replay each layer's decode step from a CUDA graph (``DecodeGraph``); None
    = when the model is on CUDA."""

    def __init__(self, model: nn.Module, capacity: int, cuda_graphs: bool | None = None) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        if cuda_graphs not in (None, True, False):
            raise TypeError(f"cuda_graphs must be None, True or False, got {cuda_graphs!r}")
        on_cuda = next(model.parameters()).device.type == "cuda"
        if cuda_graphs and not on_cuda:
            raise ValueError("cuda_graphs=True needs a model on a CUDA device")
        self.cuda_graphs = on_cuda if cuda_graphs is None else cuda_graphs
        pool = torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        super().__init__(layers=[NSACacheLayer(capacity, pool) for _ in range(model.config.num_hidden_layers)])
        self.capacity = capacity


def cache_kwarg(model: nn.Module) -> str:
    """The name under which ``model`` takes its cache: "cache" (transformers >= 5.20-ish, where
    "past_key_values" is deprecated) or "past_key_values" (earlier 5.x)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def generate(model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int, capacity: int | None = None,
             cuda_graphs: bool | None = None, **kwargs):
    """Greedy ``model.generate`` of a patched model through an ``NSAModelCache``.

    input_ids [batch, prompt] (one unpadded prompt a row; padding is not supported by the NSA
    adapter); ``capacity`` defaults to prompt + max_new_tokens; ``cuda_graphs`` as in
    ``NSAModelCache``. Other keyword arguments go to ``generate``. Returns the token ids
    [batch, prompt + generated].
    """
    capacity = capacity if capacity is not None else input_ids.shape[1] + max_new_tokens
    kwargs.setdefault("do_sample", False)
    kwargs.setdefault("pad_token_id", model.config.eos_token_id or 0)
    # All ones: generate would otherwise infer padding from tokens equal to pad_token_id.
    kwargs.setdefault("attention_mask", torch.ones_like(input_ids))
    kwargs[cache_kwarg(model)] = NSAModelCache(model, capacity, cuda_graphs)
    return model.generate(input_ids, max_new_tokens=max_new_tokens, **kwargs)
