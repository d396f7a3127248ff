"""Calibrate ``tracedump diff``'s verdict: detection and false alarms over model families and bugs.

Builds tiny models of seven families from configs (random weights, nothing downloaded): a Llama
(GQA, rotary), GPT2 (learned positions, LayerNorm), three MoE (Mixtral, whose router weights come
out of an fp32 softmax; Qwen2-MoE with a shared expert; OLMoE), T5 (encoder-decoder, ``wo`` kept
in fp32 inside bf16 as HF does) and a diffusers UNet run as a 25-step DDIM loop (one pass per
step). Each family is dumped

- clean, in fp32 and bf16, with eager and sdpa attention where the family has both;
- with one planted bug in one middle layer, in fp32 and bf16 (see :data:`BUGS`);

and every case of :func:`cases` is compared with default flags (``--baseline`` where the case
says so). The table it prints (and writes as JSON with ``--out``) is the one in
``docs/comparator.md``; ``tests/test_compare_verdict.py`` runs a slice of it.

Run: ``python benchmarks/calibrate.py [--families llama,gpt2] [--out calibration.json]``
(``make calibrate``). Dumps go to a temp dir that is deleted at the end.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tracedump
from benchmarks import common

# Weights 5x HF's default init (0.02): attention logits of a few units, as in trained models, so
# position and scale bugs show in the attention weights instead of averaging out over a flat softmax.
INIT = 0.1
Inputs = Callable[[nn.Module], None]  # runs the model (one or several forwards) under no_grad


# ----------------------------------------------------------------------------------- bugs


def _scale_output(module: nn.Module, factor: float) -> None:
    """The module's output (or the first element of its tuple) times ``factor``."""
    original = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        if isinstance(out, tuple):
            return (out[0] * factor, *out[1:])
        return out * factor

    module.forward = forward  # type: ignore[method-assign]


def _set_eps(module: nn.Module, eps: float) -> None:
    for attr in ("variance_epsilon", "eps"):
        if hasattr(module, attr):
            setattr(module, attr, eps)
            return
    raise AttributeError(f"{type(module).__name__} has no eps")


def _shift_rotary(attention: nn.Module, rotary: nn.Module) -> None:
    """Query positions off by one in this attention module only (keys keep theirs): the classic
    port bug. Shifting queries and keys together would change nothing, rotary being relative."""
    modeling = sys.modules[type(attention).__module__]
    original, apply = attention.forward, modeling.apply_rotary_pos_emb

    def forward(hidden_states: torch.Tensor, position_embeddings: Any, *args: Any, **kwargs: Any) -> Any:
        positions = torch.arange(1, hidden_states.shape[1] + 1, device=hidden_states.device)[None]
        shifted = rotary(hidden_states, positions)

        def apply_shifted(q: torch.Tensor, k: torch.Tensor, cos: Any, sin: Any, *rest: Any, **kw: Any) -> Any:
            return apply(q, k, *shifted, *rest, **kw)[0], apply(q, k, cos, sin, *rest, **kw)[1]

        modeling.apply_rotary_pos_emb = apply_shifted
        try:
            return original(hidden_states, position_embeddings, *args, **kwargs)
        finally:
            modeling.apply_rotary_pos_emb = apply

    attention.forward = forward  # type: ignore[method-assign]


def _scale_attention(attention: nn.Module, factor: float) -> None:
    attention.scaling = attention.scaling * factor


# ----------------------------------------------------------------------------------- families


@dataclass
class Family:
    """How to build, run and break one model family."""

    name: str
    build: Callable[[torch.dtype, str], nn.Module]  # (dtype, attention implementation)
    run: Inputs
    bugs: dict[str, Callable[[nn.Module], None]]
    layer: str  # regex of the module names the bugs live in (the expected first divergence)
    attentions: tuple[str, ...] = ("eager", "sdpa")
    baseline_bugs: tuple[str, ...] = ()  # bugs that bf16-vs-fp32 with --baseline must find


def _random_norms(model: nn.Module) -> nn.Module:
    """Norm weights of 1 +- 0.2: with all-ones weights some bugs (eps, scale) hide in symmetry."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name.lower() and name.endswith("weight") and param.dim() == 1:
                param.copy_(1 + 0.2 * torch.randn(param.shape, generator=generator))
    return model


def _ids(count: int, vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (1, count), generator=torch.Generator().manual_seed(seed))


def _lm_run(tokens: int, vocab: int) -> Inputs:
    ids = _ids(tokens, vocab)

    def run(model: nn.Module) -> None:
        model(input_ids=ids)

    return run


def llama_family() -> Family:
    from transformers import LlamaConfig, LlamaForCausalLM

    def build(dtype: torch.dtype, attention: str) -> nn.Module:
        config = LlamaConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            initializer_range=INIT,
            attn_implementation=attention,
        )
        torch.manual_seed(0)
        return _random_norms(LlamaForCausalLM(config)).eval().to(dtype)

    layer = lambda m: m.model.layers[3]  # noqa: E731
    return Family(
        "llama",
        build,
        _lm_run(24, 128),
        {
            "rotary": lambda m: _shift_rotary(layer(m).self_attn, m.model.rotary_emb),
            "mlp_scale": lambda m: _scale_output(layer(m).mlp, 1.02),
            "softmax_scale": lambda m: _scale_attention(layer(m).self_attn, 1.05),
            "norm_eps": lambda m: _set_eps(layer(m).input_layernorm, 0.5),
        },
        r"\.layers\.3\.",
        baseline_bugs=("rotary", "norm_eps"),
    )


def gpt2_family() -> Family:
    from transformers import GPT2Config, GPT2LMHeadModel

    def build(dtype: torch.dtype, attention: str) -> nn.Module:
        config = GPT2Config(
            vocab_size=128,
            n_embd=64,
            n_layer=4,
            n_head=4,
            n_positions=64,
            initializer_range=INIT,
            attn_implementation=attention,
        )
        torch.manual_seed(0)
        return _random_norms(GPT2LMHeadModel(config)).eval().to(dtype)

    layer = lambda m: m.transformer.h[2]  # noqa: E731
    return Family(
        "gpt2",
        build,
        _lm_run(24, 128),
        {
            "mlp_scale": lambda m: _scale_output(layer(m).mlp, 1.02),
            "softmax_scale": lambda m: _scale_attention(layer(m).attn, 1.05),
            "norm_eps": lambda m: _set_eps(layer(m).ln_2, 1e-1),
        },
        r"\.h\.2\.",
        baseline_bugs=("norm_eps",),
    )


def mixtral_family() -> Family:
    from transformers import MixtralConfig, MixtralForCausalLM

    def build(dtype: torch.dtype, attention: str) -> nn.Module:
        config = MixtralConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=64,
            initializer_range=INIT,
            attn_implementation=attention,
        )
        torch.manual_seed(0)
        return _random_norms(MixtralForCausalLM(config)).eval().to(dtype)

    layer = lambda m: m.model.layers[2]  # noqa: E731
    return Family(
        "mixtral",
        build,
        _lm_run(32, 128),
        {
            "rotary": lambda m: _shift_rotary(layer(m).self_attn, m.model.rotary_emb),
            "moe_scale": lambda m: _scale_output(layer(m).mlp, 1.02),
            "norm_eps": lambda m: _set_eps(layer(m).post_attention_layernorm, 0.1),
        },
        r"\.layers\.2\.",
        baseline_bugs=("rotary", "norm_eps"),
    )


def qwen2_moe_family() -> Family:
    """Eight experts, top-2, plus a shared expert: routing flips are common at 48 tokens."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    def build(dtype: torch.dtype, attention: str) -> nn.Module:
        config = Qwen2MoeConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=2,
            max_position_embeddings=64,
            initializer_range=INIT,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            attn_implementation=attention,
        )
        torch.manual_seed(0)
        return _random_norms(Qwen2MoeForCausalLM(config)).eval().to(dtype)

    return _moe_family("qwen2moe", build)


def olmoe_family() -> Family:
    """Eight experts, top-2, no shared expert: eager vs sdpa swaps the order of chosen experts."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    def build(dtype: torch.dtype, attention: str) -> nn.Module:
        config = OlmoeConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=48,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=2,
            max_position_embeddings=64,
            initializer_range=INIT,
            attn_implementation=attention,
        )
        torch.manual_seed(0)
        return _random_norms(OlmoeForCausalLM(config)).eval().to(dtype)

    return _moe_family("olmoe", build)


def _moe_family(name: str, build: Callable[[torch.dtype, str], nn.Module]) -> Family:
    """An 8-expert MoE: its block scaled, and a norm's eps, in layer 2; 48 tokens so routing flips."""
    layer = lambda m: m.model.layers[2]  # noqa: E731
    return Family(
        name,
        build,
        _lm_run(48, 128),
        {
            "moe_scale": lambda m: _scale_output(layer(m).mlp, 1.02),
            "norm_eps": lambda m: _set_eps(layer(m).post_attention_layernorm, 0.5),
        },
        r"\.layers\.2\.",
        baseline_bugs=("norm_eps",),
    )


def t5_family() -> Family:
    from transformers import T5Config, T5ForConditionalGeneration

    def build(dtype: torch.dtype, attention: str) -> nn.Module:
        config = T5Config(
            vocab_size=128,
            d_model=64,
            d_kv=16,
            d_ff=128,
            num_layers=3,
            num_decoder_layers=3,
            num_heads=4,
            decoder_start_token_id=0,
        )
        torch.manual_seed(0)
        model = _random_norms(T5ForConditionalGeneration(config)).eval().to(dtype)
        for name, module in model.named_modules():  # HF keeps `wo` in fp32 (_keep_in_fp32_modules)
            if name.endswith("DenseReluDense.wo"):
                module.float()
        return model

    ids, labels = _ids(20, 128), _ids(12, 128, seed=2)

    def run(model: nn.Module) -> None:
        model(input_ids=ids, decoder_input_ids=labels)

    layer = lambda m: m.decoder.block[1]  # noqa: E731
    return Family(
        "t5",
        build,
        run,
        {
            "ff_scale": lambda m: _scale_output(layer(m).layer[2].DenseReluDense, 1.02),
            "norm_eps": lambda m: _set_eps(layer(m).layer[0].layer_norm, 0.5),
        },
        r"decoder\.block\.1\.",
        attentions=("eager",),
        baseline_bugs=("norm_eps",),
    )


def unet_family(steps: int = 25) -> Family:
    from diffusers import DDIMScheduler, UNet2DModel

    def build(dtype: torch.dtype, attention: str) -> nn.Module:
        torch.manual_seed(0)
        model = UNet2DModel(
            sample_size=16,
            in_channels=3,
            out_channels=3,
            block_out_channels=(32, 64),
            down_block_types=("DownBlock2D", "AttnDownBlock2D"),
            up_block_types=("AttnUpBlock2D", "UpBlock2D"),
            layers_per_block=1,
            norm_num_groups=8,
            attention_head_dim=16,
        )
        return _random_norms(model).eval().to(dtype)

    def run(model: nn.Module) -> None:
        dtype = next(model.parameters()).dtype
        scheduler = DDIMScheduler(num_train_timesteps=1000)
        scheduler.set_timesteps(steps)
        sample = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(4)).to(dtype)
        for t in scheduler.timesteps:
            noise = model(sample, t).sample
            sample = scheduler.step(noise, t, sample).prev_sample

    block = lambda m: m.mid_block  # noqa: E731
    return Family(
        "unet",
        build,
        run,
        {
            "resnet_scale": lambda m: _scale_output(block(m).resnets[0], 1.02),
            "norm_eps": lambda m: _set_eps(block(m).resnets[0].norm1, 1e-1),
        },
        r"^mid_block\.",
        attentions=("default",),
        baseline_bugs=("norm_eps",),
    )


FAMILIES: dict[str, Callable[[], Family]] = {
    "llama": llama_family,
    "gpt2": gpt2_family,
    "mixtral": mixtral_family,
    "qwen2moe": qwen2_moe_family,
    "olmoe": olmoe_family,
    "t5": t5_family,
    "unet": unet_family,
}


# ----------------------------------------------------------------------------------- dumping


def dump_variant(family: Family, variant: str, out: Path) -> Path:
    """Dump one variant: ``<dtype>[-<attention>][+<bug>]``, e.g. ``bf16-eager+rotary``."""
    spec, _, bug = variant.partition("+")
    dtype_name, _, attention = spec.partition("-")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    model = family.build(dtype, attention or family.attentions[-1])
    if bug:
        family.bugs[bug](model)
    with common.clean_env():
        dumper = tracedump.attach(model, {"dir": str(out), "modules": "all"})
    assert dumper is not None
    with torch.no_grad():
        family.run(model)
    dumper.close()
    return out


# ----------------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    """One comparison and what it must give: exit 0 (``clean``) or exit 1 naming ``family.layer``."""

    family: str
    a: str
    b: str
    expect: str  # "clean" | "detect" | "welcome" (detection welcome, not required)
    baseline: str | None = None

    @property
    def label(self) -> str:
        return f"{self.a} vs {self.b}" + (f" (baseline {self.baseline})" if self.baseline else "")


WELCOME = {
    ("bf16", "softmax_scale"),
    ("baseline", "mlp_scale"),
    ("baseline", "moe_scale"),
}


def cases(family: Family) -> list[Case]:
    """The clean pairs that must pass and the bug pairs that must be found, for one family."""
    attention = family.attentions[-1]
    out = [Case(family.name, "bf16", "fp32", "clean")]
    if len(family.attentions) > 1:
        other = family.attentions[0]
        out += [
            Case(family.name, f"fp32-{other}", "fp32", "clean"),
            Case(family.name, f"bf16-{other}", "bf16", "clean"),
        ]
    for bug in family.bugs:
        out.append(Case(family.name, f"fp32+{bug}", "fp32", "detect"))
        eager = f"bf16-{family.attentions[0]}"  # eager attention: its weights are dumped too
        welcome = ("bf16", bug) in WELCOME
        out.append(Case(family.name, f"{eager}+{bug}", eager, "welcome" if welcome else "detect"))
        required = bug in family.baseline_bugs
        out.append(
            Case(family.name, f"bf16+{bug}", "fp32", "detect" if required else "welcome", baseline="bf16")
        )
    del attention
    return out


@dataclass
class Outcome:
    case: Case
    exit_code: int
    first: str | None
    error: float | None
    threshold: float | None
    passed: bool
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        return {
            "family": self.case.family,
            "case": self.case.label,
            "expect": self.case.expect,
            "exit": self.exit_code,
            "first_divergence": self.first,
            "error": self.error,
            "threshold": self.threshold,
            "passed": self.passed,
        }


def judge_case(case: Case, family: Family, dumps: dict[str, Path]) -> Outcome:
    from tracedump.compare import compare

    baseline = dumps[case.baseline] if case.baseline else None
    report = compare(dumps[case.a], dumps[case.b], baseline=baseline)
    first = report.first_divergence
    name = first.name if first else None
    in_layer = bool(name and re.search(family.layer, name))
    if case.expect == "clean":
        passed = report.exit_code == 0
    elif case.expect == "detect":
        passed = report.exit_code == 1 and in_layer
    else:
        passed = True
    return Outcome(
        case,
        report.exit_code,
        name,
        first.error if first else None,
        first.threshold if first else None,
        passed,
        "found" if in_layer else "",
    )


def variants_needed(family_cases: list[Case]) -> list[str]:
    needed: list[str] = []
    for case in family_cases:
        for v in (case.a, case.b, case.baseline):
            if v and v not in needed:
                needed.append(v)
    return needed


def calibrate(names: list[str], root: Path, log: Callable[[str], None] = print) -> list[Outcome]:
    outcomes: list[Outcome] = []
    for name in names:
        family = FAMILIES[name]()
        family_cases = cases(family)
        dumps: dict[str, Path] = {}
        started = time.perf_counter()
        for variant in variants_needed(family_cases):
            dumps[variant] = dump_variant(copy.copy(family), variant, root / name / variant)
        log(f"{name}: {len(dumps)} dumps in {time.perf_counter() - started:.1f} s")
        for case in family_cases:
            outcome = judge_case(case, family, dumps)
            outcomes.append(outcome)
            mark = "ok " if outcome.passed else "BAD"
            log(
                f"  {mark} {case.label:42s} expect {case.expect:7s} exit {outcome.exit_code} "
                f"first {outcome.first} ({_g(outcome.error)} > {_g(outcome.threshold)})"
            )
    return outcomes


def _g(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def markdown(outcomes: list[Outcome]) -> str:
    lines = [
        "| family | case | must | exit | first divergence | error / threshold | held |",
        "|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        must = {"clean": "exit 0", "detect": "exit 1 in layer", "welcome": "(welcome)"}[o.case.expect]
        ratio = f"{_g(o.error)} / {_g(o.threshold)}" if o.first else "-"
        lines.append(
            f"| {o.case.family} | {o.case.label} | {must} | {o.exit_code} | {o.first or '-'} | {ratio} "
            f"| {'yes' if o.passed else 'NO'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--out", type=Path, help="write the outcomes as JSON")
    parser.add_argument("--markdown", action="store_true", help="print the docs table")
    parser.add_argument("--keep", type=Path, help="keep the dumps in this dir (default: a temp dir)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    names = [n for n in args.families.split(",") if n]
    root = args.keep or Path(tempfile.mkdtemp(prefix="tracedump-calibrate-"))
    try:
        outcomes = calibrate(names, root)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    if args.markdown:
        print(markdown(outcomes))
    if args.out:
        args.out.write_text(json.dumps([o.row() for o in outcomes], indent=1) + "\n")
    failed = [o for o in outcomes if not o.passed]
    print(f"{len(outcomes) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
