"""What a build is made of, as both stages read it: the patch series (patchfile: the `git format-patch`
files, the review record each message carries, the order in patches/series) and the record of what a
build was made from (provenance: upstream, overlay, patches, kernels, toolchain, our commit). Rests on
the core alone; the build stage, the run stage and everything above read it."""
