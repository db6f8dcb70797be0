"""Operator tools that ship with the package (console scripts):

* ``mooncake-kv-size`` (:mod:`mooncake.tools.kv_size`): KV-cache bytes per token, block and
  request for a model, and how many tokens/blocks/requests fit in a capacity.
* ``mooncake-hitrate`` (:mod:`mooncake.tools.hitrate`): replays a prefix-hash trace (Mooncake's
  FAST'25 format) against a cache model or a running store and reports hit rates.
"""
