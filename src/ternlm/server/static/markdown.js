// A small Markdown subset rendered straight to DOM nodes: paragraphs, headings, fenced code blocks,
// inline code, bold, italics, strikethrough, lists (nested by indent), block quotes, rules, links.
//
// Why no HTML parser and no innerHTML: model output is untrusted text. Every character of it reaches
// the page through createTextNode / textContent, so `<script>` or `<img onerror=...>` in an answer is
// shown as those characters and never parsed as markup. Links get an href only for http(s) URLs.
// Unclosed constructs (a stream cut mid-way: "**bol", an open ``` fence) render as text / code so far.

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const QUOTE = /^ {0,3}>\s?(.*)$/;

function el(tag, cls) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  return node;
}

/** Render `text` as a DocumentFragment. Pure: reads nothing but its argument. */
export function renderMarkdown(text) {
  const frag = document.createDocumentFragment();
  renderBlocks(String(text).replace(/\r\n?/g, "\n").split("\n"), frag);
  return frag;
}

function indentOf(s) {
  return s.replace(/\t/g, "    ").match(/^ */)[0].length;
}

function renderBlocks(lines, parent) {
  let para = [];           // pending paragraph lines
  let lists = [];          // open lists, outermost first: {indent, node, ordered, item}
  const flushPara = () => {
    if (!para.length) return;
    const p = el("p");
    para.forEach((line, i) => {
      if (i) p.appendChild(document.createElement("br"));
      renderInline(line, p);
    });
    (lists.length ? lists[lists.length - 1].item : parent).appendChild(p);
    para = [];
  };
  const closeLists = () => { flushPara(); lists = []; };

  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    let m;
    if ((m = line.match(FENCE))) {
      flushPara();
      const fence = m[1], body = [];
      const indent = indentOf(line);
      for (i++; i < lines.length; i++) {
        const close = lines[i].trim();
        if (close.length >= fence.length && close[0] === fence[0] && /^(`+|~+)$/.test(close)) break;
        body.push(indent ? lines[i].replace(new RegExp(`^ {0,${indent}}`), "") : lines[i]);
      }
      const nested = lists.length > 0 && indent > lists[0].indent;   // a code block inside a list item
      (nested ? lists[lists.length - 1].item : parent).appendChild(codeBlock(body.join("\n"), m[2]));
      if (!nested) lists = [];
      continue;
    }
    if (!line.trim()) {
      flushPara();
      // a blank line ends the lists unless the next non-blank line continues one
      let j = i + 1;
      while (j < lines.length && !lines[j].trim()) j++;
      if (lists.length && !(j < lines.length && (ITEM.test(lines[j]) || indentOf(lines[j]) > lists[0].indent))) lists = [];
      continue;
    }
    if ((m = line.match(ITEM)) && !RULE.test(line)) {
      flushPara();
      const indent = indentOf(m[1]);
      const ordered = /\d/.test(m[2]);
      while (lists.length && indent < lists[lists.length - 1].indent) lists.pop();
      let top = lists[lists.length - 1];
      if (top && indent === top.indent && top.ordered !== ordered) { lists.pop(); top = lists[lists.length - 1]; }
      if (!top || indent > top.indent) {
        const list = el(ordered ? "ol" : "ul");
        if (ordered) {
          const start = parseInt(m[2], 10);
          if (start !== 1) list.start = start;
        }
        (top ? top.item : parent).appendChild(list);
        top = { indent, node: list, ordered, item: null };
        lists.push(top);
      }
      top.item = el("li");
      top.node.appendChild(top.item);
      if (m[3].trim()) para.push(m[3]);
      continue;
    }
    if (lists.length && indentOf(line) > lists[0].indent && para.length === 0 && !QUOTE.test(line)) {
      para.push(line.trim());           // an indented line after a blank: a new paragraph in the item
      continue;
    }
    if (lists.length && para.length && indentOf(line) > lists[0].indent) {
      para.push(line.trim());           // lazy continuation of the item's text
      continue;
    }
    closeLists();
    if ((m = line.match(HEADING))) {
      const h = el("h" + Math.min(6, m[1].length + 2));
      renderInline(m[2], h);
      parent.appendChild(h);
    } else if (RULE.test(line)) {
      parent.appendChild(el("hr"));
    } else if (QUOTE.test(line)) {
      const inner = [];
      while (i < lines.length && (m = lines[i].match(QUOTE))) { inner.push(m[1]); i++; }
      i--;
      const q = el("blockquote");
      renderBlocks(inner, q);
      parent.appendChild(q);
    } else {
      para.push(line);
    }
  }
  flushPara();
}

function codeBlock(code, lang) {
  const wrap = el("div", "code-block");
  const bar = el("div", "code-bar");
  const label = el("span", "code-lang");
  label.textContent = lang || "text";
  const copy = el("button", "code-copy");
  copy.type = "button";
  copy.textContent = "Copy";
  copy.addEventListener("click", () => {
    navigator.clipboard?.writeText(code).then(() => {
      copy.textContent = "Copied";
      setTimeout(() => { copy.textContent = "Copy"; }, 1200);
    }, () => { copy.textContent = "Copy failed"; });
  });
  bar.append(label, copy);
  const pre = el("pre");
  const c = el("code");
  c.textContent = code;
  if (lang) c.dataset.lang = lang;
  pre.appendChild(c);
  wrap.append(bar, pre);
  return wrap;
}

const PUNCT = /[!-\/:-@\[-`{-~]/;
const WORD = /[\p{L}\p{N}]/u;

/** Append the inline rendering of `text` to `parent` (text nodes and inline elements only). */
export function renderInline(text, parent) {
  let buf = "";
  const flush = () => { if (buf) { parent.appendChild(document.createTextNode(buf)); buf = ""; } };
  const wrap = (tag, inner) => { flush(); const node = el(tag); renderInline(inner, node); parent.appendChild(node); };
  let i = 0;
  while (i < text.length) {
    const ch = text[i];
    if (ch === "\\" && i + 1 < text.length && PUNCT.test(text[i + 1])) {
      buf += text[i + 1];
      i += 2;
      continue;
    }
    if (ch === "`") {
      let n = 1;
      while (text[i + n] === "`") n++;
      const ticks = "`".repeat(n);
      let j = text.indexOf(ticks, i + n);
      while (j >= 0 && text[j + n] === "`") j = text.indexOf(ticks, j + n + 1);   // longer run: not ours
      if (j < 0) { buf += ticks; i += n; continue; }
      let inner = text.slice(i + n, j);
      if (inner.length > 2 && inner[0] === " " && inner[inner.length - 1] === " ") inner = inner.slice(1, -1);
      flush();
      const code = el("code");
      code.textContent = inner;
      parent.appendChild(code);
      i = j + n;
      continue;
    }
    if ((ch === "*" || ch === "_" || ch === "~") && text[i + 1] === ch) {
      const d = ch + ch;
      const j = closing(text, i + 2, d);
      if (j > i + 2 && !(ch === "_" && WORD.test(text[i - 1] || ""))) {
        wrap(ch === "~" ? "del" : "strong", text.slice(i + 2, j));
        i = j + 2;
        continue;
      }
      buf += d;
      i += 2;
      continue;
    }
    if ((ch === "*" || ch === "_") && text[i + 1] && !/\s/.test(text[i + 1])
        && !(ch === "_" && WORD.test(text[i - 1] || ""))) {
      const j = closing(text, i + 1, ch);
      if (j > i + 1 && !(ch === "_" && WORD.test(text[j + 1] || ""))) {
        wrap("em", text.slice(i + 1, j));
        i = j + 1;
        continue;
      }
    }
    if (ch === "[") {
      const m = text.slice(i).match(/^\[([^\]\n]+)\]\(\s*(\S+?)\s*\)/);
      const href = m && safeUrl(m[2]);
      if (href) {
        flush();
        const a = el("a");
        a.href = href;
        a.target = "_blank";
        a.rel = "noopener noreferrer nofollow";
        renderInline(m[1], a);
        parent.appendChild(a);
        i += m[0].length;
        continue;
      }
    }
    buf += ch;
    i++;
  }
  flush();
}

/** Index of the delimiter `d` closing a span opened before `from` (not preceded by a space), or -1. */
function closing(text, from, d) {
  for (let j = text.indexOf(d, from); j >= 0; j = text.indexOf(d, j + 1)) {
    if (text[j - 1] === "\\" || /\s/.test(text[j - 1])) continue;
    if (d.length === 1 && text[j + 1] === d) { j++; continue; }   // part of a double delimiter
    return j;
  }
  return -1;
}

/** The URL if it is absolute http(s), else null (no javascript:, data:, relative paths). */
export function safeUrl(raw) {
  try {
    const u = new URL(raw);
    return u.protocol === "http:" || u.protocol === "https:" ? u.href : null;
  } catch {
    return null;
  }
}
