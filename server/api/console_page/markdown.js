// Model output is text: it is escaped before the few Markdown forms below turn into tags, so a reply can
// never inject markup.
export function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

function inline(text) {
  return text.replace(/`([^`]+)`/g, "<code>$1</code>")
    .replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>")
    .replace(/\*([^*\s][^*]*)\*/g, "<em>$1</em>");
}

export function renderMarkdown(source) {
  const parts = escapeHtml(source).split(/```[^\n]*\n?/);
  return parts.map((part, i) => {
    // a fence's own line breaks are not content: without trimming them a block ends, or the next
    // paragraph starts, with an empty line
    if (i % 2 === 1) return "<pre><code>" + part.replace(/\n$/, "") + "</code></pre>";
    return part.replace(/^\n+/, "").split(/\n{2,}/).filter((p) => p.trim()).map((para) => {
      const lines = para.split("\n");
      if (lines.every((l) => /^\s*[-*] /.test(l))) return "<ul>" + lines.map((l) => "<li>" + inline(l.replace(/^\s*[-*] /, "")) + "</li>").join("") + "</ul>";
      if (/^#{1,6} /.test(para)) return "<p><strong>" + inline(para.replace(/^#+ /, "")) + "</strong></p>";
      return "<p>" + lines.map(inline).join("<br>") + "</p>";
    }).join("");
  }).join("");
}
