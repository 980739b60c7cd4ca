//! JSON highlighting with syntect, converted to ratatui lines. The syntax and theme sets load
//! once (a few ms) and are shared; callers highlight only what is on screen.

use std::sync::OnceLock;

use ratatui::style::{Color, Style};
use ratatui::text::{Line, Span};
use syntect::easy::HighlightLines;
use syntect::highlighting::ThemeSet;
use syntect::parsing::SyntaxSet;
use syntect::util::LinesWithEndings;

fn syntaxes() -> &'static SyntaxSet {
    static S: OnceLock<SyntaxSet> = OnceLock::new();
    S.get_or_init(SyntaxSet::load_defaults_newlines)
}

fn themes() -> &'static ThemeSet {
    static T: OnceLock<ThemeSet> = OnceLock::new();
    T.get_or_init(ThemeSet::load_defaults)
}

/// Whether syntect ships a theme of this name.
pub fn has_syntax_theme(name: &str) -> bool {
    themes().themes.contains_key(name)
}

/// Highlight `text` as JSON; at most `max_lines` lines. Falls back to plain lines when the
/// syntax or theme is unknown.
pub fn json_lines(text: &str, syntax_theme: &str, max_lines: usize) -> Vec<Line<'static>> {
    let ss = syntaxes();
    let (Some(syntax), Some(theme)) = (
        ss.find_syntax_by_extension("json"),
        themes().themes.get(syntax_theme),
    ) else {
        return text
            .lines()
            .take(max_lines)
            .map(|l| Line::raw(l.to_string()))
            .collect();
    };
    let mut h = HighlightLines::new(syntax, theme);
    let mut out = Vec::new();
    for line in LinesWithEndings::from(text).take(max_lines) {
        let spans = match h.highlight_line(line, ss) {
            Ok(ranges) => ranges
                .into_iter()
                .map(|(style, s)| {
                    let fg = style.foreground;
                    Span::styled(
                        s.trim_end_matches('\n').to_string(),
                        Style::default().fg(Color::Rgb(fg.r, fg.g, fg.b)),
                    )
                })
                .collect(),
            Err(_) => vec![Span::raw(line.trim_end_matches('\n').to_string())],
        };
        out.push(Line::from(spans));
    }
    out
}

/// Pretty JSON if `value` parses as JSON, else the text unchanged.
pub fn pretty(text: &str) -> String {
    serde_json::from_str::<serde_json::Value>(text)
        .ok()
        .and_then(|v| serde_json::to_string_pretty(&v).ok())
        .unwrap_or_else(|| text.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_is_coloured_per_token() {
        let lines = json_lines("{\"a\": 1, \"b\": \"x\"}", "base16-ocean.dark", 10);
        assert_eq!(lines.len(), 1);
        assert!(lines[0].spans.len() > 3, "{:?}", lines[0]);
        let text: String = lines[0].spans.iter().map(|s| s.content.as_ref()).collect();
        assert_eq!(text, "{\"a\": 1, \"b\": \"x\"}");
    }

    #[test]
    fn unknown_theme_falls_back_to_plain() {
        let lines = json_lines("{}\n[]", "nope", 10);
        assert_eq!(lines.len(), 2);
    }
}
