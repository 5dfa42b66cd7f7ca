"""Tiny random M2M100 models for the NLLB tests: the HF oracle and the same weights for us.

The vocabulary mimics NLLB's layout (sentencepiece pieces, then the 202 language codes), so
language ids are real vocabulary rows; sources are random piece ids, no text is involved.
Weights are drawn wider than HF's init and the EOS logit is raised, so that the tiny model
makes confident choices and finishes hypotheses early enough to exercise beam search.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from spark_jax.config import config_from_hf  # noqa: E402
from spark_jax.models import nllb  # noqa: E402
from spark_jax.tokenizer.nllb_languages import FAIRSEQ_LANGUAGE_CODES  # noqa: E402

SPM_SIZE = 96
FIRST_PIECE = 4  # 0..3 are <s>, <pad>, </s>, <unk>
LANGUAGE_IDS = {code: SPM_SIZE + 1 + i for i, code in enumerate(FAIRSEQ_LANGUAGE_CODES)}
VOCAB_SIZE = SPM_SIZE + 1 + len(FAIRSEQ_LANGUAGE_CODES) + 1  # + <mask>
EOS = 2
MAX_POSITIONS = 128


def tiny_hf(encoder_layers: int = 2, decoder_layers: int = 3, seed: int = 0, eos_boost=6.0):
    """An eval-mode ``M2M100ForConditionalGeneration`` with seeded, widened random weights."""
    from transformers import M2M100Config, M2M100ForConditionalGeneration

    config = M2M100Config(
        vocab_size=VOCAB_SIZE,
        d_model=32,
        encoder_layers=encoder_layers,
        decoder_layers=decoder_layers,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=MAX_POSITIONS,
    )
    torch.manual_seed(seed)
    model = M2M100ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layer_norm.weight"):
                p.normal_(1.0, 0.1)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.05)
            elif name == "model.shared.weight":
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.5)
        # A small embedding keeps the residual stream from echoing the last token (the head is
        # tied); a wide final-norm gain restores confident logits.
        model.model.decoder.layer_norm.weight.normal_(4.0, 0.5)
        # The head is tied: a final-norm bias along EOS's embedding raises EOS's logit.
        eos_row = model.model.shared.weight[EOS]
        model.model.decoder.layer_norm.bias += eos_boost * eos_row / eos_row.square().sum()
    return model


def ours(hf_model, default_tgt_lang: str | None = "fra_Latn") -> nllb.NllbRunner:
    """The same weights as a spark_jax runner (fp32), with a {code: id} language map."""
    config = config_from_hf(hf_model.config.to_dict())
    tensors = {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}
    params = jax.tree_util.tree_map(jax.numpy.asarray, nllb.params_from_hf(config, tensors))
    return nllb.NllbRunner(config, params, LANGUAGE_IDS, default_tgt_lang=default_tgt_lang)


def random_source(rng: np.random.Generator, length: int, src_lang: str = "eng_Latn") -> list[int]:
    """An NLLB-format source ``[src_lang] pieces </s>`` of ``length`` tokens in all."""
    pieces = rng.integers(FIRST_PIECE, SPM_SIZE + 1, size=length - 2).tolist()
    return [LANGUAGE_IDS[src_lang], *pieces, EOS]


def random_sources(seed: int, count: int, min_len: int = 3, max_len: int = 24) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [random_source(rng, int(rng.integers(min_len, max_len + 1))) for _ in range(count)]


def padded_batch(sources: list[list[int]], pad: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and attention mask, as HF's tokenizer pads a batch."""
    width = max(len(s) for s in sources)
    ids = torch.full((len(sources), width), pad, dtype=torch.long)
    mask = torch.zeros((len(sources), width), dtype=torch.long)
    for i, s in enumerate(sources):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids, mask


def strip_hf_output(row: list[int], eos: int = EOS) -> list[int]:
    """HF's ``[decoder_start, forced_bos, tokens..., eos, pad...]`` → ``tokens..., eos``."""
    out = row[2:]
    return out[: out.index(eos) + 1] if eos in out else out
