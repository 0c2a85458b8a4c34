// Vercel AI SDK (ai + @ai-sdk/openai): streamText on the default provider instance's
// default model (`openai(model)`: the Responses API with store: true), a zod-typed tool,
// and the SDK's own tool loop (stopWhen). Its second step refers to the first step's
// output items by id (item_reference); the gateway resolves them from this container's
// own earlier answers (docs/agents.md).
import { openai } from "@ai-sdk/openai";
import { stepCountIs, streamText, tool } from "ai";
import { z } from "zod";
import { readLog, TOOL_DESCRIPTION } from "../common.ts";

export async function run(question: string, system: string, model: string): Promise<string> {
  const result = streamText({
    model: openai(model),
    system,
    prompt: question,
    tools: {
      read_log: tool({
        description: TOOL_DESCRIPTION,
        inputSchema: z.object({ service: z.string().describe("the service's name") }),
        execute: async ({ service }) => readLog(service),
      }),
    },
    stopWhen: stepCountIs(4),
  });
  let text = "";
  for await (const part of result.textStream) text += part;
  const steps = await result.steps;
  return steps.length ? steps[steps.length - 1].text : text;
}
