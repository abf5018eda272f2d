"""Schedule: partition an ATen graph into Extern, Fused, View and Fallback steps (plan.py), by the
rules of rules.py and the op support table of op_support.py."""
