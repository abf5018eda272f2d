"""Schedule: partition an ATen graph into Extern, Fused, View and Fallback steps."""
