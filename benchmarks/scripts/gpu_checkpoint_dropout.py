"""Activation checkpointing with dropout on the GPU: the recompute draws the forward's mask, the
backward compiles, and what the CUDA-graph runner made of each graph.

    PYTHONPATH=src python benchmarks/scripts/gpu_checkpoint_dropout.py [--json PATH]

out = sum(dropout(x * w)) = sum(mask * x * w) / (1 - p), so out == (w * grad_w).sum() exactly when
the backward's mask is the forward's. Three calls per variant (non-reentrant and reentrant
checkpoints), fresh masks each call; then a Hugging Face BERT with gradient checkpointing and
dropout trained for three steps beside eager (losses, finite gradients).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from torch.utils.checkpoint import checkpoint

import ember


class DropoutInCheckpoint(torch.nn.Module):
    """out = sum(dropout(x * w)) = sum(mask * x * w) / (1 - p), so d out / d w = sum(mask * x) / (1 - p)
    and out == (w * grad_w).sum() exactly when the backward's mask is the forward's (also the CPU
    tests' model: tests/capture/test_activation_checkpointing.py)."""

    def __init__(self, reentrant: bool, features: int = 1024) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(features))
        self.drop = torch.nn.Dropout(0.5)
        self.reentrant = reentrant

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(x * self.w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=self.reentrant).sum()


def graphs_of(compiled: object) -> list[dict]:
    return [{"kind": g.kind, "target": g.target, "cudagraph": g.cudagraph, "error": g.error}
            for g in compiled._ember_backend.log.graphs]


def mask_rows() -> list[dict]:
    rows = []
    for reentrant in (False, True):
        torch.manual_seed(0)
        model = DropoutInCheckpoint(reentrant).cuda()
        compiled = ember.compile(model, warm_start=False)
        x = torch.randn(256, 1024, device="cuda")
        worst, grads = 0.0, set()
        for _ in range(3):
            out = compiled(x)
            out.backward()
            worst = max(worst, abs(out.item() - (model.w * model.w.grad).sum().item()) / max(1.0, abs(out.item())))
            grads.add(round(model.w.grad.sum().item(), 4))
            model.w.grad = None
        rows.append({"case": f"dropout in a {'reentrant' if reentrant else 'non-reentrant'} checkpoint",
                     "mask_mismatch_rel": worst, "distinct_masks_of_3": len(grads), "ok": worst < 1e-4 and len(grads) == 3,
                     "graphs": graphs_of(compiled)})
    return rows


def bert_row() -> dict:
    import copy

    import transformers
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=256, max_position_embeddings=128)
    model = transformers.BertForSequenceClassification(cfg).cuda().train()
    model.gradient_checkpointing_enable()
    ref = copy.deepcopy(model)
    compiled = ember.compile(model, warm_start=False)
    ids, labels = torch.randint(0, 1000, (4, 64), device="cuda"), torch.randint(0, 2, (4,), device="cuda")
    losses = []
    for _ in range(3):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = compiled(input_ids=ids, labels=labels).loss
            want = ref(input_ids=ids, labels=labels).loss
        loss.backward()
        want.backward()
        finite = all(torch.isfinite(p.grad).all().item() for p in model.parameters() if p.grad is not None)
        losses.append((loss.item(), want.item(), finite))
        model.zero_grad()
        ref.zero_grad()
    return {"case": "transformers BERT, gradient checkpointing, dropout 0.1, bf16", "losses_ember_eager_finite": losses,
            "ok": all(f for *_, f in losses), "graphs": graphs_of(compiled)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = mask_rows()
    try:
        rows.append(bert_row())
    except Exception as err:  # noqa: BLE001 - the row says what failed
        rows.append({"case": "transformers BERT", "ok": False, "error": f"{type(err).__name__}: {err}"[:500]})
    for row in rows:
        print(f"{'ok ' if row['ok'] else 'BAD'} {row['case']}: "
              + ", ".join(f"{k}={v}" for k, v in row.items() if k not in ("case", "ok", "graphs")))
        for g in row.get("graphs", []):
            print(f"      {g['kind']:9s} {g['target']:24s} cudagraph: {g['cudagraph']}  {g['error'] or ''}")
    if args.json:
        env = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1, default=str)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
