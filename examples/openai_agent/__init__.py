"""openai_agent: the minimal agent, a plain openai client inside @al.rollout."""
