# agent.py
import openai

import agentloop as al


@al.rollout
async def agent(task: dict, llm: al.LLM) -> float:
    client = openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key)
    resp = await client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task["question"]}], max_tokens=16
    )
    return float(task["answer"] in (resp.choices[0].message.content or ""))  # the reward
