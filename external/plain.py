"""`plain`: each agent sees its first prompt, its previous answer (with external.show_partner, the
other agents' too) and a request to revise it. Works with any env; in the code env the answer is
shown as code and the request names the function to write."""
from __future__ import annotations

from magrpo.feedback import FEEDBACK

from .prompts import assemble, fenced, in_conversation

REVISE = "Revise your previous answer and give an improved version."


@FEEDBACK.register("plain")
def plain(prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent, **context):
    options = context.get("options", {})
    if "functions" not in context:  # an env without code context: plain text
        out = []
        for i in range(num_agents):
            if in_conversation(options):  # the first prompt and the answer are earlier messages already
                parts = [f"Agent {j}'s previous answer:\n{agent_completions[j]}" for j in range(num_agents)
                         if j != i and options.get("show_partner", False)]
                out.append("\n\n".join(parts + [REVISE]))
                continue
            parts = [prompt_history_per_agent[i][0]] if options.get("original_prompt", True) else []
            if options.get("history", False):
                parts += [
                    f"Your answer at turn {t + 1}:\n{r}" for t, r in enumerate(response_history_per_agent[i][:-1])
                ]
            parts.append(f"Your previous answer:\n{agent_completions[i]}")
            if options.get("show_partner", False):
                parts += [f"Agent {j}'s previous answer:\n{agent_completions[j]}" for j in range(num_agents) if j != i]
            out.append("\n\n".join(parts + [REVISE]))
        return out
    out = []
    for i in range(num_agents):
        partner = ""
        if options.get("show_partner", False):
            partner = "\n\n".join(f"{_whose(j, num_agents)} previous code (`{context['functions'][j]}`):\n"
                                  f"{fenced(context['code'][j] or '# (no code)')}" for j in range(num_agents) if j != i)
        out.append(assemble(i, num_agents, context, prompt_history_per_agent, response_history_per_agent, partner))
    return out


def _whose(agent: int, num_agents: int) -> str:
    return "The other agent's" if num_agents == 2 else f"Agent {agent}'s"
