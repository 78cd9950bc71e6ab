"""The rollout layer that RL and evaluation share, between the environments and the inference client.

`sampler`: the environments' `Sampler` over the inference client (seeds, sessions, policy versions);
`guard`: a rollout's timeout and failure accounting (an environment's exception fails that rollout only).
The orchestrator and `tidal eval` both import these; neither imports the other for them. (Extending a
conversation's exact token ids, which multi-turn environments do, is tidal.envs.chat: rollout uses envs,
never the other way.)
"""
