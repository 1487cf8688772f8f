"""A user feedback function for tests/test_feedback_custom.py: appends its arguments as JSON lines
to $MAGRPO_PROBE_LOG and returns one prompt per agent."""
import json
import os


def record(prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent):
    with open(os.environ["MAGRPO_PROBE_LOG"], "a") as f:
        f.write(json.dumps({
            "prompt": prompt, "agent_completions": agent_completions, "num_agents": num_agents,
            "prompt_history_per_agent": prompt_history_per_agent,
            "response_history_per_agent": response_history_per_agent,
        }) + "\n")
    return [f"probe turn {len(prompt_history_per_agent[i]) + 1} for agent {i}" for i in range(num_agents)]


def wrong_count(prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent):
    return ["only one prompt"]


def record_context(prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent,
                   **context):
    with open(os.environ["MAGRPO_PROBE_LOG"], "a") as f:
        f.write(json.dumps({
            "agent_completions": agent_completions, "prompt_history_per_agent": prompt_history_per_agent,
            "response_history_per_agent": response_history_per_agent, "context": context,
        }) + "\n")
    return [f"probe turn {len(prompt_history_per_agent[i]) + 1} for agent {i}" for i in range(num_agents)]


def raises(prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent):
    raise RuntimeError("the feedback function failed")


def wrong_signature(prompt, completions):
    """The arguments by other names: the call passes agent_completions=..."""
    return [prompt, prompt]
