"""A gpt-fast-style PyTorch peer: a Llama transformer with a static KV cache, compiled steps.

    python -m benchmarks gpt_fast --peer-json FILE --peer-arg serving|decode [--tiny]

(what ``peer_in_subprocess("gpt_fast", tiny, timeout_s, arg)`` runs; this is a peer, not a
suite). Written in the spirit of pytorch-labs/gpt-fast: plain PyTorch modules (RMSNorm, RoPE
with the config's rescaling, GQA, SwiGLU, tied or untied head), one preallocated cache per
layer, K and V [B, K, S, H] (gpt-fast's layout: attention reads it with no transpose)
written with ``index_copy_`` at the input's slots, attention by
``scaled_dot_product_attention`` under a mask over the whole static cache. On CUDA the decode
step (greedy argmax inside) is ``torch.compile(mode="reduce-overhead", fullgraph=True)`` (CUDA
graphs); its attention is written out (bf16 products, an fp32 softmax, as HF's eager
attention), which inductor fuses, as gpt-fast's decode fuses the math SDPA backend (torch 2.11's
math backend computes bf16 inputs in fp32: a bs=64 step read its cache as fp32 copies, 63 ms
against 8.9). Prefill is compiled with dynamic shapes and runs SDPA. On the CPU nothing is
compiled (tests only).

Static batches: a batch's prompts are left-padded to its longest and share the cache slots;
row b's token at slot s has RoPE position s - pad[b] and attends to slots pad[b]..s (a pad
slot only to itself, so no row of the softmax is empty). Every row decodes to the batch's
longest output; a short last batch is filled with copies of its first prompt. Weights: a
seeded random init (HF's normal(0, 0.02)) from our ``ModelConfig``, or an HF
``LlamaForCausalLM`` state dict. Imports torch at module level: only the peer's own process
imports this module.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.common import llama, torch_median_seconds
from spark_jax.config import ModelConfig

INIT_STD = 0.02  # HF LlamaConfig's initializer_range
WARMUP_TOKENS = 4  # decode calls before timing: CUDA graph trees warm up, then record
CACHE_ALIGN = 128  # the static cache length is a multiple of this (aligned mask rows)


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), False)

    def forward(self, x: Tensor) -> Tensor:
        # statistics in fp32, the product in the input's dtype, as HF's LlamaRMSNorm
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class KVCache(nn.Module):
    """One layer's static K and V: module buffers, so a CUDA graph writes them in place."""

    def __init__(self, batch: int, max_len: int, heads: int, head_dim: int, like: Tensor) -> None:
        super().__init__()
        shape = (batch, heads, max_len, head_dim)  # [B, K, S, H]
        for name in ("k", "v"):
            buffer = torch.zeros(shape, dtype=like.dtype, device=like.device)
            torch._dynamo.mark_static_address(buffer)
            self.register_buffer(name, buffer, persistent=False)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Writes k, v [B, T, K, H] at slots ``input_pos`` [T]; returns the whole cache,
        [B, K, S, H]."""
        self.k.index_copy_(2, input_pos, k.transpose(1, 2))
        self.v.index_copy_(2, input_pos, v.transpose(1, 2))
        return self.k, self.v


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on x [B, T, N, H] in HF's half-split layout; cos, sin [B, T, H]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, :, None] + rotated * sin[:, :, None]


def grouped_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """q [B, T, N, H], k and v [B, K, S, H], mask [B, T, S] (True: attend) -> [B, T, N*H].

    The G = N / K query heads of a KV head are folded into its query rows, so the cache is
    read once per KV head and never repeated G times."""
    b, t, n, h = q.shape
    kv, s = k.shape[1], k.shape[2]
    g = n // kv
    q = q.view(b, t, kv, g, h).permute(0, 2, 3, 1, 4).reshape(b, kv, g * t, h)
    mask = mask[:, None, None].expand(b, 1, g, t, s).reshape(b, 1, g * t, s)
    if t == 1:  # decode: written out, for inductor to fuse (the module docstring says why)
        scores = (q @ k.transpose(-1, -2)) * h**-0.5
        scores = scores.masked_fill(~mask, float("-inf"))
        out = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v
    else:
        out = F.scaled_dot_product_attention(q, k, v, mask)
    return out.view(b, kv, g, t, h).permute(0, 3, 1, 2, 4).reshape(b, t, n * h)


class Block(nn.Module):
    def __init__(self, c: ModelConfig, weight: Callable[..., nn.Parameter], like: Tensor) -> None:
        super().__init__()
        self.config = c
        self.attention_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, like.dtype, like.device)
        self.wqkv = weight(c.qkv_size, c.hidden_size)
        self.wo = weight(c.hidden_size, c.q_size)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, like.dtype, like.device)
        self.w_gate_up = weight(2 * c.intermediate_size, c.hidden_size)
        self.w_down = weight(c.hidden_size, c.intermediate_size)
        self.cache: KVCache | None = None

    def attention(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, pos: Tensor) -> Tensor:
        c, (b, t, _) = self.config, x.shape
        q, k, v = F.linear(x, self.wqkv).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = rotate(q.view(b, t, c.num_heads, c.head_dim), cos, sin)
        k = rotate(k.view(b, t, c.num_kv_heads, c.head_dim), cos, sin)
        k, v = self.cache.update(pos, k, v.view(b, t, c.num_kv_heads, c.head_dim))
        return F.linear(grouped_attention(q, k, v, mask), self.wo)

    def mlp(self, x: Tensor) -> Tensor:
        gate, up = F.linear(x, self.w_gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.w_down)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, pos: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask, pos)
        return h + self.mlp(self.ffn_norm(h))


class Transformer(nn.Module):
    """A Llama-architecture decoder; ``setup_caches`` before the first call."""

    def __init__(
        self, config: ModelConfig, dtype: str | torch.dtype, device: str, seed: int = 0
    ) -> None:
        super().__init__()
        c, dtype = config, _dtype(dtype)
        generator = torch.Generator(device).manual_seed(seed)

        def weight(*shape: int) -> nn.Parameter:
            data = torch.empty(shape, dtype=dtype, device=device)
            return nn.Parameter(data.normal_(0.0, INIT_STD, generator=generator), False)

        self.config = c
        self.embed = weight(c.vocab_size, c.hidden_size)
        like = self.embed
        self.layers = nn.ModuleList(Block(c, weight, like) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, like.device)
        self.lm_head = self.embed if c.tie_word_embeddings else weight(c.vocab_size, c.hidden_size)
        inv_freq = torch.tensor(c.rope.inverse_frequencies(c.head_dim), dtype=torch.float32)
        self.register_buffer("inv_freq", inv_freq.to(like.device), persistent=False)
        self.max_len = 0

    @classmethod
    def from_hf(
        cls, config: ModelConfig, state: dict[str, Tensor], device: str = "cpu"
    ) -> Transformer:
        """The weights of an HF ``LlamaForCausalLM`` state dict (q/k/v and gate/up fused)."""
        model = cls(config, state["model.embed_tokens.weight"].dtype, device)
        with torch.no_grad():
            model.embed.copy_(state["model.embed_tokens.weight"])
            for i, layer in enumerate(model.layers):
                p = f"model.layers.{i}."
                qkv = [state[f"{p}self_attn.{x}_proj.weight"] for x in "qkv"]
                layer.wqkv.copy_(torch.cat(qkv))
                layer.wo.copy_(state[f"{p}self_attn.o_proj.weight"])
                gate_up = [state[f"{p}mlp.{x}_proj.weight"] for x in ("gate", "up")]
                layer.w_gate_up.copy_(torch.cat(gate_up))
                layer.w_down.copy_(state[f"{p}mlp.down_proj.weight"])
                layer.attention_norm.weight.copy_(state[f"{p}input_layernorm.weight"])
                layer.ffn_norm.weight.copy_(state[f"{p}post_attention_layernorm.weight"])
            model.norm.weight.copy_(state["model.norm.weight"])
            if not config.tie_word_embeddings:
                model.lm_head.copy_(state["lm_head.weight"])
        return model

    def setup_caches(self, batch: int, max_len: int) -> None:
        """A zeroed static cache of ``batch`` rows and ``max_len`` slots in every layer."""
        c, self.max_len = self.config, max_len
        for layer in self.layers:
            layer.cache = KVCache(batch, max_len, c.num_kv_heads, c.head_dim, self.embed)

    @property
    def batch(self) -> int:
        return self.layers[0].cache.k.shape[0]

    def forward(self, ids: Tensor, input_pos: Tensor, pads: Tensor) -> Tensor:
        """ids [B, T] at cache slots input_pos [T], rows left-padded by pads [B] -> normed
        hidden states [B, T, D]."""
        # RoPE is shift-invariant, but HF's positions (from 0 in each row) give HF's very
        # angles, and so its rounding in bf16.
        positions = (input_pos[None, :] - pads[:, None]).clamp(min=0)  # [B, T]
        freqs = positions[..., None].float() * self.inv_freq  # fp32 angles, as HF
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos().to(self.embed.dtype), angles.sin().to(self.embed.dtype)
        slots = torch.arange(self.max_len, device=ids.device)
        first = torch.minimum(pads[:, None], input_pos[None, :])  # [B, T]
        mask = (slots <= input_pos[None, :, None]) & (slots >= first[..., None])  # [B, T, S]
        x = F.embedding(ids, self.embed)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, input_pos)
        return self.norm(x)

    def logits(self, hidden: Tensor) -> Tensor:
        return F.linear(hidden, self.lm_head)


def prefill(model: Transformer, ids: Tensor, input_pos: Tensor, pads: Tensor) -> Tensor:
    """The greedy next token [B, 1] after the prompts ids [B, T] (only the last logits)."""
    return model.logits(model(ids, input_pos, pads)[:, -1:]).argmax(-1)


def decode_one(model: Transformer, token: Tensor, input_pos: Tensor, pads: Tensor) -> Tensor:
    """The greedy next token [B, 1] after token [B, 1] at slot input_pos [1]."""
    return model.logits(model(token, input_pos, pads)).argmax(-1)


@dataclass(frozen=True)
class Runner:
    """A model and its two steps, compiled on CUDA as gpt-fast compiles them."""

    model: Transformer
    prefill: Callable[..., Tensor]
    decode: Callable[..., Tensor]

    @classmethod
    def of(cls, model: Transformer) -> Runner:
        if model.embed.device.type != "cuda":
            return cls(model, prefill, decode_one)
        torch._inductor.config.coordinate_descent_tuning = True  # gpt-fast's setting
        decode = torch.compile(decode_one, mode="reduce-overhead", fullgraph=True)
        return cls(model, torch.compile(prefill, dynamic=True, fullgraph=True), decode)


def generate(
    runner: Runner,
    prompts: list[list[int]],
    new_tokens: int,
    phases: dict[str, float] | None = None,
) -> list[list[int]]:
    """``new_tokens`` greedy tokens of each prompt, all in one static batch. ``phases``: the
    prefill's and the decode steps' seconds are added to its "prefill_s" and "decode_s" (the
    device synced between them: once a batch)."""
    model = runner.model
    rows = model.batch
    if not 0 < len(prompts) <= rows:
        raise ValueError(f"{len(prompts)} prompts do not fit a static batch of {rows} rows.")
    width = max(len(p) for p in prompts)
    if width + new_tokens > model.max_len:
        raise ValueError(
            f"a prompt of {width} tokens and {new_tokens} new ones exceed the cache's "
            f"{model.max_len} slots; set up a longer cache."
        )
    filled = prompts + [prompts[0]] * (rows - len(prompts))
    ids = torch.zeros((rows, width), dtype=torch.long)
    pads = torch.tensor([width - len(p) for p in filled])
    for row, prompt in enumerate(filled):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
    device = model.embed.device
    ids, pads = ids.to(device), pads.to(device)
    clock = _Clock(device, phases)
    with torch.no_grad():
        token = runner.prefill(model, ids, torch.arange(width, device=device), pads).clone()
        clock.lap("prefill_s")
        tokens, pos = [token], torch.tensor([width], device=device)
        for _ in range(new_tokens - 1):
            token = runner.decode(model, token, pos, pads).clone()  # outlives the graph
            tokens.append(token)
            pos += 1
        out = torch.cat(tokens, dim=1)[: len(prompts)].tolist()
        clock.lap("decode_s")
    return out


class _Clock:
    """Adds the seconds since the last lap to ``phases[name]`` (nothing without phases),
    the device synced first."""

    def __init__(self, device: torch.device, phases: dict[str, float] | None) -> None:
        self.device, self.phases, self.last = device, phases, time.perf_counter()

    def lap(self, name: str) -> None:
        if self.phases is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self.last
        self.last = now


def _random_model(config: ModelConfig, dtype: str, device: str) -> Transformer:
    return Transformer(config, dtype, device).eval()


def _aligned(n: int) -> int:
    return -(-n // CACHE_ALIGN) * CACHE_ALIGN


def decode_step_seconds(
    config: ModelConfig, batch: int, context: int, dtype: str, device: str, steps: int
) -> float:
    """Seconds per greedy decode step of ``batch`` rows after a ``context``-token prompt:
    CUDA events per step (the host clock on the CPU), median over ``steps`` steps."""
    model = _random_model(config, dtype, device)
    model.setup_caches(batch, _aligned(context + WARMUP_TOKENS + steps + 1))
    runner = Runner.of(model)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (batch, context), generator=generator).to(device)
    pads = torch.zeros(batch, dtype=torch.long, device=device)
    with torch.no_grad():
        token = runner.prefill(model, ids, torch.arange(context, device=device), pads).clone()
        pos, state = torch.tensor([context], device=device), {"token": token}

        def step() -> None:
            state["token"] = runner.decode(model, state["token"], pos, pads).clone()
            pos.add_(1)

        return torch_median_seconds(step, warmup=WARMUP_TOKENS, iters=steps)


def static_batches(
    config: ModelConfig,
    requests: list[tuple[list[int], int]],
    batch: int,
    dtype: str,
    device: str,
    max_len: int,
) -> dict[str, Any]:
    """Serves (prompt ids, output length) requests in static batches of ``batch``, each
    decoding to its longest output; only each request's own tokens count as useful. A
    short run of every batch compiles first, untimed (each prompt width a prefill of its
    own: the dynamic-shape prefill recompiles at its second width); every batch is then
    timed."""
    model = _random_model(config, dtype, device)
    model.setup_caches(batch, _aligned(max_len))
    runner = Runner.of(model)
    chunks = [requests[i : i + batch] for i in range(0, len(requests), batch)]
    for chunk in chunks:
        generate(runner, [p for p, _ in chunk], WARMUP_TOKENS + 2)
    useful = computed = steps = 0
    phases: dict[str, float] = {}
    start = time.perf_counter()
    for chunk in chunks:
        longest = max(n for _, n in chunk)
        outputs = generate(runner, [p for p, _ in chunk], longest, phases)  # synced
        useful += sum(min(n, len(out)) for out, (_, n) in zip(outputs, chunk, strict=True))
        computed += batch * longest
        steps += longest - 1
    wall = time.perf_counter() - start
    return {
        "device": str(device),
        "batch": batch,
        "requests": len(requests),
        "useful_output_tokens": useful,
        "computed_output_tokens": computed,
        "wall_s": wall,
        "output_tok_s": useful / wall,
        # Where the time went: the prefills, and the decode steps (each of every row).
        "prefill_s": phases.get("prefill_s", 0.0),
        "decode_ms_per_step": phases.get("decode_s", 0.0) / max(steps, 1) * 1e3,
    }


def peer(tiny: bool, arg: str = "") -> dict[str, Any]:
    """``arg`` "serving": static batches over the serving suite's workload (its HF peer's
    batch and requests); "decode": per-step decode rates at the decode suite's two shapes."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    info = {"device": device, "torch": torch.__version__}
    if arg == "serving":
        from benchmarks import serving

        plan = serving.SMALL if tiny else serving.FULL
        requests = serving.workload(plan)[: plan.hf_requests]
        args = (plan.config, requests, plan.hf_batch, plan.dtype, device, plan.max_model_len)
        return info | static_batches(*args)
    if arg == "decode":
        from benchmarks import decode

        plan = decode.TINY if tiny else decode.FULL
        config, dtype = llama(tiny)
        for rows, context in ((1, plan.bs1_prompt), (plan.batch, plan.batch_prompt)):
            seconds = decode_step_seconds(config, rows, context, dtype, device, plan.hf_steps)
            info[f"bs{rows}_tok_s"] = rows / seconds
            info[f"bs{rows}_context"] = context
            if device == "cuda":
                torch.cuda.empty_cache()
        return info
    raise ValueError(f"gpt_fast peer argument {arg!r} is unknown; pass 'serving' or 'decode'.")
