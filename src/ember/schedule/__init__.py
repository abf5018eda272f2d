"""Schedule: partition an ATen graph into Extern, Fused, View and Fallback steps (plan.py), by the
rules of rules.py and the op support table of op_support.py; dim_map.py places a fused member's
dims on its group's reference shape, range_select.py plans cat / slice_scatter as shifted loads."""
