"""A continuous-batching engine over the HF Llama's own modules, with ``set_batch`` wired in.

What vLLM/SGLang do, in small: requests arrive at different steps; each step packs the tokens of
every running request into one ``[tokens, hidden]`` batch (no padding): a prefill is cut into
chunks of at most ``chunk`` tokens (chunked prefill), a request past its prefill adds one token per
step (decode), and prefill chunks and decodes share steps. Attention reads each request's own KV
cache. The projections, norms and MLPs are the HF model's modules called on packed rows, so the
dump's names are HF's and a batch-1 HF forward over each full sequence is the reference.

Each step runs inside ``dumper.step()`` and tells tracedump what its rows hold::

    with dumper.step():
        dumper.set_batch(seq_ids=rows_seq, positions=rows_pos, input_ids=rows_tok)
        logits = model_step(...)

so ``tracedump diff ENGINE REF --align tokens`` compares each request position by position.
``bug_layer`` plants a decode-only bug: in that layer, a decode token's key is rotated for the
position after its own (the classic off-by-one of a KV-cache write at decode); prefill is right.

Run: ``TRACEDUMP_DUMP_DIR=/tmp/e TRACEDUMP_DUMP_MODULES=all python examples/batching.py
[--bug-layer 1]``; then ``python examples/batching.py --reference`` dumps the reference with
``TRACEDUMP_DUMP_DIR=/tmp/r``. Importing this module has no side effects.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine import ModelConfig, build_model

import tracedump


@dataclass
class Request:
    """A prompt arriving at ``arrival`` (a step number), to be extended by ``new_tokens`` tokens."""

    seq_id: int
    prompt: list[int]
    arrival: int
    new_tokens: int
    tokens: list[int] = field(default_factory=list)  # prompt + generated so far
    prefilled: int = 0  # prompt tokens already through the model

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)

    @property
    def done(self) -> bool:
        return len(self.tokens) >= len(self.prompt) + self.new_tokens


def default_requests() -> list[Request]:
    """Three requests of different lengths arriving at steps 0, 1 and 3."""
    generator = torch.Generator().manual_seed(7)

    def prompt(n: int) -> list[int]:
        return torch.randint(0, 64, (n,), generator=generator).tolist()

    return [
        Request(0, prompt(11), arrival=0, new_tokens=4),
        Request(1, prompt(5), arrival=1, new_tokens=5),
        Request(2, prompt(7), arrival=3, new_tokens=3),
    ]


class PackedLlama:
    """One step over packed rows of several sequences, through the HF model's modules."""

    def __init__(self, model: nn.Module, bug_layer: int | None = None) -> None:
        self.model = model
        self.config = model.config
        self.bug_layer = bug_layer
        self.cache: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    @torch.no_grad()
    def step(
        self, seq_ids: list[int], positions: list[int], input_ids: list[int], decode: list[bool]
    ) -> torch.Tensor:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        inner = self.model.model
        heads, kv_heads = self.config.num_attention_heads, self.config.num_key_value_heads
        head_dim = self.config.hidden_size // heads
        ids = torch.tensor(input_ids)
        pos = torch.tensor(positions)
        hidden = inner.embed_tokens(ids)
        cos, sin = inner.rotary_emb(hidden[None], pos[None])
        shifted = inner.rotary_emb(hidden[None], (pos + 1)[None]) if self.bug_layer is not None else None
        is_decode = torch.tensor(decode)
        for index, layer in enumerate(inner.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attn.q_proj(x).view(1, -1, heads, head_dim).transpose(1, 2)
            k = attn.k_proj(x).view(1, -1, kv_heads, head_dim).transpose(1, 2)
            v = attn.v_proj(x).view(1, -1, kv_heads, head_dim).transpose(1, 2)
            q_rot, k_rot = apply_rotary_pos_emb(q, k, cos, sin)
            if index == self.bug_layer and shifted is not None:  # decode rows: key rotated one too far
                _, k_bug = apply_rotary_pos_emb(q, k, *shifted)
                k_rot = torch.where(is_decode[None, None, :, None], k_bug, k_rot)
            out = self._attend(index, seq_ids, positions, q_rot[0], k_rot[0], v[0], heads // kv_heads)
            hidden = hidden + attn.o_proj(out.transpose(0, 1).reshape(len(ids), -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.model.lm_head(inner.norm(hidden))

    def _attend(
        self, layer: int, seq_ids: list[int], positions: list[int], q: torch.Tensor, k: torch.Tensor,
        v: torch.Tensor, groups: int,
    ) -> torch.Tensor:  # fmt: skip
        """Causal attention of each row over its own sequence's cache (this step's keys appended)."""
        out = torch.empty_like(q)
        for seq in dict.fromkeys(seq_ids):
            rows = [r for r, s in enumerate(seq_ids) if s == seq]
            caches = self.cache.setdefault(seq, [])
            if len(caches) <= layer:
                caches.append((k[:, :0], v[:, :0]))
            keys = torch.cat([caches[layer][0], k[:, rows]], dim=1)
            values = torch.cat([caches[layer][1], v[:, rows]], dim=1)
            caches[layer] = (keys, values)
            keys, values = keys.repeat_interleave(groups, 0), values.repeat_interleave(groups, 0)
            scores = q[:, rows] @ keys.transpose(1, 2) * (q.shape[-1] ** -0.5)
            key_positions = torch.arange(keys.shape[1])
            mask = key_positions[None, :] > torch.tensor([positions[r] for r in rows])[:, None]
            scores = scores.masked_fill(mask[None], float("-inf"))
            out[:, rows] = scores.softmax(-1) @ values
        return out


def serve(
    model: nn.Module,
    requests: list[Request],
    *,
    chunk: int = 4,
    bug_layer: int | None = None,
    dump: bool = True,
) -> list[Request]:
    """Continuous batching with chunked prefill until every request is done; one pass per step."""
    dumper = tracedump.attach(model) if dump else None
    engine = PackedLlama(model, bug_layer)
    step = 0
    while not all(r.done for r in requests):
        running = [r for r in requests if r.arrival <= step and not r.done]
        seq_ids, positions, input_ids, decode = [], [], [], []
        for request in running:
            if request.prefilled < len(request.prompt):
                start = request.prefilled
                take = list(range(start, min(start + chunk, len(request.prompt))))
                request.prefilled = take[-1] + 1
            else:
                take = [len(request.tokens) - 1]
            seq_ids += [request.seq_id] * len(take)
            positions += take
            input_ids += [request.tokens[p] for p in take]
            decode += [p >= len(request.prompt) for p in take]
        if seq_ids:
            with dumper.step() if dumper else _nothing():
                if dumper is not None:
                    dumper.set_batch(seq_ids=seq_ids, positions=positions, input_ids=input_ids)
                logits = engine.step(seq_ids, positions, input_ids, decode)
            _sample(running, seq_ids, logits)
        step += 1
    if dumper is not None:
        dumper.close()
    return requests


def _sample(running: list[Request], seq_ids: list[int], logits: torch.Tensor) -> None:
    """Greedy: a request whose prefill is through gets a token from its last row this step."""
    for request in running:
        rows = [r for r, s in enumerate(seq_ids) if s == request.seq_id]
        if rows and request.prefilled == len(request.prompt) and not request.done:
            request.tokens.append(int(logits[rows[-1]].argmax()))


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def reference(model: nn.Module, sequences: list[list[int]]) -> None:
    """The batch-1 reference: one HF forward over each full sequence (teacher forcing)."""
    dumper = tracedump.attach(model)
    with torch.no_grad():
        for tokens in sequences:
            model(input_ids=torch.tensor([tokens]))
    if dumper is not None:
        dumper.close()


def fed_tokens(requests: list[Request]) -> list[list[int]]:
    """What the engine fed for each request: every token but the last one generated."""
    return [r.tokens[:-1] for r in sorted(requests, key=lambda r: r.arrival)]


def main() -> None:
    parser = argparse.ArgumentParser(description="Serve three requests with continuous batching.")
    parser.add_argument("--bug-layer", type=int, default=None, help="plant the decode-only rotary bug here")
    parser.add_argument("--reference", action="store_true", help="dump the batch-1 HF reference instead")
    parser.add_argument(
        "--chunk", type=int, default=4, help="prefill chunk size, tokens per request per step"
    )
    args = parser.parse_args()
    model = build_model(ModelConfig())
    if args.reference:
        served = serve(build_model(ModelConfig()), default_requests(), chunk=args.chunk, dump=False)
        reference(model, fed_tokens(served))
        print(f"reference: {len(served)} sequences")
        return
    served = serve(model, default_requests(), chunk=args.chunk, bug_layer=args.bug_layer)
    for request in served:
        print(f"request {request.seq_id}: {request.tokens[len(request.prompt) :]}")


if __name__ == "__main__":
    main()
