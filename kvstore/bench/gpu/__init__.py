"""``kvstore bench gpu``: the GPU path against the hardware it runs on.

``rig`` builds an engine cache and device pages of every codec; ``paths`` times the kernels
against a device copy and the PCIe link; ``ready`` puts the time to make a prefix ready from
each tier beside a full prefill; ``host`` (``--host-overhead``) measures the host's share of
``EngineCache`` save and load.
"""
