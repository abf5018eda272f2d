"""Does the partition's stand-in for Inductor's pattern matcher (capture/partition.py) number every
joint graph's mutation regions as torch's own helper does? For each model, one training step through
``ember.compile`` (CPU, small inputs); each joint graph AOTAutograd hands to the partition is checked:
decidable by the stand-in or not, and the region ids of both helpers compared node by node. Equal ids
mean torch's CSE, and so the min-cut partition, make the same forward and backward graphs either way.

    PYTHONPATH=src python benchmarks/scripts/partition_regions_check.py [MODEL ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

DEFAULT = ["tiny_transformer", "resnet18", "mobilenet_v3", "densenet121", "resnet50v2", "bert", "cyclegan",
           "style_transfer", "vgg16", "swin_t", "vit_b16", "convnext_t", "efficientnet_b0", "gpt2", "llama", "t5",
           "bart", "lstm_lm"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="*", default=DEFAULT)
    parser.add_argument("--json")
    args = parser.parse_args()

    from torch._inductor.pattern_matcher import compute_mutation_region_ids as torch_regions

    import ember
    import ember.capture.backend as backend
    from ember.bench import models
    from ember.capture import partition

    rows: list[dict] = []
    current: dict = {}

    def checked(joint_module, joint_inputs, **kwargs):
        graph = joint_module.graph
        decidable = partition.regions_decidable(graph)
        partition.compute_mutation_region_ids(graph)
        ours = [n.meta["mutation_region_id"] for n in graph.nodes]
        torch_regions(graph)
        theirs = [n.meta["mutation_region_id"] for n in graph.nodes]
        current["graphs"].append({"nodes": len(ours), "decidable": decidable, "equal": ours == theirs,
                                  "regions": max(theirs, default=0)})
        return partition.partition_joint_graph(joint_module, joint_inputs, **kwargs)

    backend.partition_joint_graph = checked
    for name in args.models:
        current = {"model": name, "graphs": []}
        try:
            case = models.get_case(name)
            torch.manual_seed(0)
            model = case.build(True).train()
            x, y = models.make_batches(case, 2, torch.device("cpu"), small=True, count=1)[0]
            compiled = ember.compile(model, target="aten", cache=False)
            case.loss(compiled(*x), y).backward()
        except Exception as err:  # noqa: BLE001 - a model that does not build here is reported
            current["error"] = f"{type(err).__name__}: {str(err)[:200]}"
        torch._dynamo.reset()
        rows.append(current)
        graphs = current["graphs"]
        print(f"{name:16s} joint graphs {len(graphs)}: decidable {sum(g['decidable'] for g in graphs)}, "
              f"region ids equal {sum(g['equal'] for g in graphs)}, nodes {sum(g['nodes'] for g in graphs)}, "
              f"mutation regions {[g['regions'] for g in graphs]}" + (f"  ERROR {current['error']}" if "error" in current else ""),
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "rows": rows}, f, indent=1)
    bad = [r["model"] for r in rows if any(not g["equal"] for g in r["graphs"])]
    print("all equal" if not bad else f"DIFFERENT: {bad}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
