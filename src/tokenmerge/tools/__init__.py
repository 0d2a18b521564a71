"""The tool wing: what the command-line tools (``bench``, ``quality``, ``demo``) share.

Layers, each importing only the ones before it (``tests/test_tools_layout.py`` checks it):

1. the core (``tokenmerge.apply_patch`` and friends), which never imports the tools;
2. ``tools``: method specs (``methods``), output files that never overwrite a user's file (``outputs``), capped
   quoting of user text in errors (``text``), loading a real pipeline with errors that say what happened
   (``pipelines``), the bench's zero-overhead limits (``limits``: ``SlicePlan``, ``slice_match``,
   ``slice_downsample``), the peers' caches as methods (``peers``, ``cachedit``);
3. ``bench`` and ``quality``: independent of each other;
4. ``cli``: the argument parsers, on top of everything.

The tools use the core through its public API only (``apply_patch``, ``apply_config``, ``observe``,
``describe_patch``, the configs, ``measure``: float PSNR and device-synchronised timing) and, for the limits, the
merge primitives of ``tokenmerge.merge``.
"""
