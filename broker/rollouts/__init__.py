"""Rollout drivers built on the client: multi-turn token rollouts, chat-template tokens and prompt
rendering on a vLLM server."""
