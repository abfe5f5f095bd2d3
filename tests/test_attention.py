"""A frozen graph's attention kernels (`server/engine/runtime/cpu_attention.py`): the chunked kernel is
SDPA's arithmetic, only plain calls are routed to it, each shape's kernel is the one measured
faster, and a routed function traced with freezing draws its eager outputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._inductor import config as inductor_config

from server.engine.runtime.cpu_attention import CHUNK, Routed, Shape, choose_kernels, chunked, plain, routed


def qkv(queries: int, keys: int, dim: int = 40, value_dim: int | None = None) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    shapes = [(2, 4, queries, dim), (2, 4, keys, dim), (2, 4, keys, value_dim or dim)]
    return tuple(torch.randn(shape, generator=generator) for shape in shapes)


@pytest.mark.parametrize(
    "queries, keys, value_dim",
    [(CHUNK * 2, CHUNK * 2, None), (CHUNK + 37, 77, None), (16, 300, 24)],  # a last chunk short; cross
)
def test_chunked_attention_is_sdpas_arithmetic(queries: int, keys: int, value_dim: int | None) -> None:
    q, k, v = qkv(queries, keys, value_dim=value_dim)
    assert torch.allclose(chunked(q, k, v), F.scaled_dot_product_attention(q, k, v), atol=1e-5)


def test_only_plain_calls_are_routed_and_only_the_shapes_chosen() -> None:
    q, k, v = qkv(CHUNK, CHUNK)
    shape = plain((q, k, v), {})
    assert shape == Shape(tuple(q.shape), tuple(k.shape), tuple(v.shape), torch.float32)
    mask = torch.zeros(CHUNK, CHUNK, dtype=torch.bool)
    for kwargs in ({"attn_mask": mask}, {"is_causal": True}, {"dropout_p": 0.1}, {"scale": 0.5}):
        assert plain((q, k, v), kwargs) is None, kwargs
    other = qkv(CHUNK, 77)
    with torch.inference_mode(), Routed(frozenset({shape})):
        mine = F.scaled_dot_product_attention(q, k, v)
        theirs = F.scaled_dot_product_attention(*other)
        causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(mine, chunked(q, k, v))  # routed: the chosen shape
    assert torch.equal(theirs, F.scaled_dot_product_attention(*other))  # as it was: not chosen
    assert torch.equal(causal, F.scaled_dot_product_attention(q, k, v, is_causal=True))  # not plain


def test_each_shape_seen_is_measured_and_a_routed_graph_frozen_draws_eager_outputs() -> None:
    """Two attention shapes (a self- and a cross-attention, as a UNet's transformer block), both
    measured; then the function routed chunked for both, compiled with freezing as the server's
    frozen graphs are, equals its eager outputs."""
    torch.manual_seed(0)
    project = torch.nn.Linear(40, 40).eval()
    context = torch.randn(2, 4, 77, 40)

    def attend(x: torch.Tensor) -> torch.Tensor:
        h = project(x)
        h = F.scaled_dot_product_attention(h, h, h)
        return F.scaled_dot_product_attention(h, context, context)

    x = torch.randn(2, 4, CHUNK + 37, 40)
    kernels = choose_kernels(attend, (x,))
    assert len(kernels) == 2 and set(kernels.values()) <= {"flash", "chunked"}, kernels
    everything = dict.fromkeys(kernels, "chunked")
    graph = torch.compile(routed(attend, everything), fullgraph=True, dynamic=False)
    with torch.inference_mode(), inductor_config.patch(freezing=True):
        assert torch.allclose(graph(x), attend(x), atol=1e-5)
