"""Build stage: from the pinned vLLM source to the artifacts we ship.

Owns fetching and verifying the source (fetch), the patched tree build/vllm with its kernel overlay
and one commit per patch (tree, patches, patchfile), the wheel, the container image and its
rehearsal, the export for a scoring repository, provenance records, the kernels' compile checks
(kernels) and the full-compile rehearsal. Imports the core and, for the contest's rules, `contest`;
never `lab`."""
