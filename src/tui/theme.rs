//! Themes as data: views ask for a meaning (`tool_call`, `simulated`, `divergence`…), never a
//! colour. The shipped themes (`themes/*.toml`) are compiled in; files in the user's config
//! directory (`<config>/themes/*.toml`) are added on top and win on a name clash.

use std::path::{Path, PathBuf};
use std::str::FromStr;

use ratatui::style::{Color, Modifier, Style};
use serde::Deserialize;

/// Failures loading a theme file.
#[derive(Debug, thiserror::Error)]
pub enum ThemeError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: String, message: String },
    #[error("{path}: colour `{slot}` = {value:?} is not a colour name or #rrggbb")]
    Colour {
        path: String,
        slot: String,
        value: String,
    },
}

/// The shipped themes, in cycling order.
pub const BUILTIN: [(&str, &str); 3] = [
    ("dark", include_str!("../../themes/dark.toml")),
    ("light", include_str!("../../themes/light.toml")),
    (
        "high-contrast",
        include_str!("../../themes/high-contrast.toml"),
    ),
];

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ThemeFile {
    name: String,
    #[serde(default = "default_syntax")]
    syntax: String,
    colors: ColorsFile,
}

fn default_syntax() -> String {
    "base16-ocean.dark".into()
}

macro_rules! slots {
    ($($slot:ident),* $(,)?) => {
        #[derive(Debug, Deserialize)]
        #[serde(deny_unknown_fields)]
        struct ColorsFile { $($slot: String,)* }

        /// Resolved colours, one per meaning.
        #[derive(Debug, Clone, PartialEq)]
        pub struct Palette { $(pub $slot: Color,)* }

        impl Palette {
            fn from_file(path: &str, c: &ColorsFile) -> Result<Self, ThemeError> {
                Ok(Self { $($slot: colour(path, stringify!($slot), &c.$slot)?,)* })
            }
        }
    };
}

slots!(
    fg,
    bg,
    muted,
    title,
    border,
    border_focus,
    selection_bg,
    tab_active,
    status_fg,
    status_bg,
    tool_call,
    simulated,
    real,
    divergence,
    irreversible,
    reward_good,
    reward_bad,
    error,
    warning,
    ok,
    accent,
);

fn colour(path: &str, slot: &str, value: &str) -> Result<Color, ThemeError> {
    Color::from_str(value).map_err(|_| ThemeError::Colour {
        path: path.to_string(),
        slot: slot.to_string(),
        value: value.to_string(),
    })
}

/// A loaded theme.
#[derive(Debug, Clone, PartialEq)]
pub struct Theme {
    pub name: String,
    /// syntect theme used for JSON highlighting.
    pub syntax: String,
    pub c: Palette,
}

impl Theme {
    /// Parse a theme from TOML text (`origin` names it in errors).
    pub fn parse(text: &str, origin: &str) -> Result<Self, ThemeError> {
        let f: ThemeFile = toml::from_str(text).map_err(|e| ThemeError::Parse {
            path: origin.to_string(),
            message: e.to_string(),
        })?;
        Ok(Self {
            c: Palette::from_file(origin, &f.colors)?,
            name: f.name,
            syntax: f.syntax,
        })
    }

    pub fn load(path: &Path) -> Result<Self, ThemeError> {
        let text = std::fs::read_to_string(path).map_err(|source| ThemeError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&text, &path.display().to_string())
    }

    /// The built-in dark theme (always parses: a test checks every shipped file).
    pub fn fallback() -> Self {
        Self::parse(BUILTIN[0].1, "themes/dark.toml").unwrap_or_else(|_| Self {
            name: "fallback".into(),
            syntax: default_syntax(),
            c: Palette {
                fg: Color::Reset,
                bg: Color::Reset,
                muted: Color::DarkGray,
                title: Color::Cyan,
                border: Color::Gray,
                border_focus: Color::Cyan,
                selection_bg: Color::Blue,
                tab_active: Color::Yellow,
                status_fg: Color::Black,
                status_bg: Color::Gray,
                tool_call: Color::Cyan,
                simulated: Color::Magenta,
                real: Color::Green,
                divergence: Color::Yellow,
                irreversible: Color::Red,
                reward_good: Color::Green,
                reward_bad: Color::Red,
                error: Color::Red,
                warning: Color::Yellow,
                ok: Color::Green,
                accent: Color::Yellow,
            },
        })
    }

    pub fn base(&self) -> Style {
        Style::default().fg(self.c.fg).bg(self.c.bg)
    }
    pub fn fg(&self, c: Color) -> Style {
        Style::default().fg(c)
    }
    pub fn muted(&self) -> Style {
        self.fg(self.c.muted)
    }
    pub fn title(&self) -> Style {
        self.fg(self.c.title).add_modifier(Modifier::BOLD)
    }
    pub fn border(&self, focused: bool) -> Style {
        self.fg(if focused {
            self.c.border_focus
        } else {
            self.c.border
        })
    }
    pub fn selected(&self) -> Style {
        Style::default()
            .bg(self.c.selection_bg)
            .add_modifier(Modifier::BOLD)
    }
    pub fn reward(&self, r: f64) -> Style {
        self.fg(if r >= 0.5 {
            self.c.reward_good
        } else {
            self.c.reward_bad
        })
    }
}

/// Every theme available: the built-ins, then user files (a user file with a built-in's name
/// replaces it). Bad user files are returned as errors and skipped.
pub fn available(user_dir: Option<&Path>) -> (Vec<Theme>, Vec<ThemeError>) {
    let mut themes = Vec::new();
    let mut errors = Vec::new();
    for (name, text) in BUILTIN {
        match Theme::parse(text, &format!("themes/{name}.toml")) {
            Ok(t) => themes.push(t),
            Err(e) => errors.push(e),
        }
    }
    if let Some(dir) = user_dir {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "toml"))
            .collect();
        files.sort();
        for p in files {
            match Theme::load(&p) {
                Ok(t) => match themes.iter_mut().find(|x| x.name == t.name) {
                    Some(slot) => *slot = t,
                    None => themes.push(t),
                },
                Err(e) => errors.push(e),
            }
        }
    }
    (themes, errors)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_file_in_themes_dir_loads() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("themes");
        let mut n = 0;
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "toml") {
                let t = Theme::load(&p).unwrap();
                assert!(
                    crate::tui::highlight::has_syntax_theme(&t.syntax),
                    "{}",
                    t.syntax
                );
                n += 1;
            }
        }
        assert!(n >= 3);
        assert_eq!(available(None).0.len(), BUILTIN.len());
    }

    #[test]
    fn bad_colour_names_the_slot() {
        let text = BUILTIN[0]
            .1
            .replace("tool_call = \"#96b5b4\"", "tool_call = \"mauve\"");
        let e = Theme::parse(&text, "x.toml").unwrap_err().to_string();
        assert!(
            e.contains("tool_call") && e.contains("mauve") && e.contains("x.toml"),
            "{e}"
        );
    }

    #[test]
    fn missing_slot_is_a_parse_error_naming_the_file() {
        let text = BUILTIN[0].1.replace("divergence = \"#d08770\"\n", "");
        let e = Theme::parse(&text, "y.toml").unwrap_err().to_string();
        assert!(e.contains("y.toml") && e.contains("divergence"), "{e}");
    }

    #[test]
    fn user_theme_replaces_builtin_of_same_name() {
        let d = tempfile::tempdir().unwrap();
        let text = BUILTIN[1].1.replace("#1d4ed8", "#000000");
        std::fs::write(d.path().join("mine.toml"), text).unwrap();
        std::fs::write(d.path().join("broken.toml"), "name = 1").unwrap();
        let (themes, errors) = available(Some(d.path()));
        assert_eq!(themes.len(), 3);
        assert_eq!(themes[1].c.title, Color::Rgb(0, 0, 0));
        assert_eq!(errors.len(), 1);
    }
}
