"""Build stage: from the pinned vLLM source to the artifacts we ship.

Owns fetching and verifying the source (fetch), the patched tree build/vllm with its kernel overlay
and one commit per patch (tree, patches), the wheel, the container image and its
rehearsal, the kernels' compile checks
(kernels) and the full-compile rehearsal. Imports the core, `contest` (the rules
the patch linter checks) and `recipe` (the series' files, provenance records); never `lab`."""
