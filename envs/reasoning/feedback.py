"""`reasoning_gym` feedback (env=reasoning_gym's default): after each turn every agent is told the
verifier's verdict on its own answer (right, partly right, wrong, or why there was none to score:
no answer tags, empty tags, a reply cut off before its answer), never the right answer. The checker
also sees the solvers' replies, without their verdicts: checking them is its job.

Prompt layout, as the other built-in modes (external/prompts.py): the agent's first prompt
(external.original_prompt=false: its role and the question in two lines), its earlier replies
(external.history=attempts), its previous reply, the verdict, others' replies, the instruction. In a
conversation (external.history=messages | continuation) it already sees its first prompt and reply."""
from __future__ import annotations

from magrpo.external.prompts import in_conversation
from magrpo.feedback import FEEDBACK

FORMAT = "between <answer> and </answer>"


def verdict(answer: str | None, score: float, truncated: bool) -> str:
    """The verifier's verdict on one agent's answer, without the right answer."""
    if answer is None and truncated:
        return f"no answer: your reply was cut off before it gave one. Be briefer and end with your answer {FORMAT}."
    if answer is None:
        return f"no answer found: give your final answer {FORMAT}."
    if not answer:
        return "your answer tags are empty."
    if score >= 1.0:
        return "your answer is correct."
    if score > 0.0:
        return f"your answer is partly right (score {score:.2f} of 1), not the exact answer."
    return "your answer is wrong."


def instruction(role: str) -> str:
    if role == "checker":
        return (f"Check the solvers' work step by step, correct any mistake, and give the team's final answer "
                f"{FORMAT}.")
    return f"Revise your work and give your final answer {FORMAT}."


def role_line(agent: int, num_agents: int, role: str, question: str) -> str:
    """external.original_prompt=false: who the agent is, and the question."""
    who = f"You are agent {agent} of {num_agents}, the {role}.\n" if num_agents > 1 else ""
    return f"{who}Question: {question}"


def shown_to(agent: int, roles: list[str], show_partner: bool) -> list[int]:
    """Whose previous replies `agent` sees: the checker always sees the solvers'; with
    external.show_partner, every agent sees all the others'."""
    return [j for j in range(len(roles)) if j != agent
            and (show_partner or roles[agent] == "checker" and roles[j] == "solver")]


@FEEDBACK.register("reasoning_gym")
def reasoning_gym(prompt, agent_completions, num_agents, prompt_history_per_agent, response_history_per_agent,
                  **context):
    options, roles = context.get("options", {}), context["roles"]
    infos = context.get("completion_info") or [{}] * num_agents
    out = []
    for i in range(num_agents):
        parts = []
        if not in_conversation(options):  # else the agent has its first prompt and its reply already
            first = prompt_history_per_agent[i][0]
            parts.append(first if options.get("original_prompt", True) else role_line(i, num_agents, roles[i], prompt))
            if options.get("history", False):
                parts += [f"Your reply at turn {t + 1}:\n{r}" for t, r in enumerate(response_history_per_agent[i][:-1])]
            parts.append(f"Your previous reply:\n{agent_completions[i]}")
        cut = infos[i].get("truncated", False)
        parts.append("Verifier: " + verdict(context["answers"][i], context["scores"][i], cut))
        parts += [f"Agent {j}'s previous reply ({roles[j]}):\n{agent_completions[j]}"
                  for j in shown_to(i, roles, options.get("show_partner", False))]
        parts.append(instruction(roles[i]))
        out.append("\n\n".join(parts))
    return out


reasoning_gym.requires_context = frozenset({"answers", "scores", "roles"})
