"""Lab: the GPU stand-in harness, not part of the product.

Owns what an end-to-end run on a GPU machine needs: the bundle (gpu_bundle), the long-lived bench
client (benchworker), servers side by side (servers, kept up across invocations on request), the
measured tiers (tiers), plumbing and fault checks, the packed Triton cache, summaries (e2e*) and the
decode analysis (e2e_decode). Rests on every layer below it and drives `builder` and `run` through
their functions; only the commands (cli) import this package."""
