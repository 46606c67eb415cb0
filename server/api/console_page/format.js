// How figures read: counts with their nouns, sizes, shares, and the figures under a reply.
export const plural = (n, noun) => `${n} ${noun}${n === 1 ? "" : "s"}`;
export const mib = (bytes) => (bytes / 2 ** 20).toFixed(1) + " MiB";
export const pct = (part, whole) => (whole ? Math.min(100, (100 * part) / whole) : 0).toFixed(1) + "%";
export const clock = (date) => date.toLocaleTimeString([], { hour12: false });

// The axis top for a sparkline: the next of 1, 2, 5 times a power of ten at or above the peak.
export function niceCeil(value) {
  const power = 10 ** Math.floor(Math.log10(Math.max(value, 1)));
  return [1, 2, 5, 10].map((m) => m * power).find((top) => top >= value);
}

export function replyStats(started, first, usage) {
  const end = performance.now();
  const parts = [];
  if (first) parts.push(`TTFT ${(first - started).toFixed(0)} ms`);
  if (usage) {
    if (first && usage.completion_tokens > 1) parts.push(`${(usage.completion_tokens / ((end - first) / 1000)).toFixed(1)} tokens/s`);
    parts.push(plural(usage.completion_tokens, "token"));
    const cached = usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : 0;
    parts.push(`${cached} of ${usage.prompt_tokens} prompt tokens cached`);
  }
  return parts.join(" · ");
}
