//! CloudWatch Metrics Insights queries, as the template's alarms and dashboard write them, read so that the tests
//! can check them against the metrics the functions print, like a plain metric row. Unlike a search expression, a
//! query names its metric and its whole dimension set (`SCHEMA`), so it can be checked:
//!
//! ```text
//! SELECT <AVG|COUNT|MAX|MIN|SUM>(<metric>) FROM SCHEMA(<namespace>, <key>, ...)
//!   [WHERE <key> = '<value>' [AND ...]] [GROUP BY <key>, ...] [ORDER BY <FUNCTION>() [ASC|DESC]] [LIMIT <n>]
//! ```
//!
//! Keywords are case-insensitive; an identifier is a word of letters, digits, `_` and `.`, or any text in double
//! quotes (a backslash escapes the next character); a label value is in single quotes. A value that is
//! [`super::ref_placeholder`] text stands for `!Ref <id>`, as in a dashboard body.

use std::collections::BTreeSet;
use std::fmt;

use super::metric::{FunctionDimension, MetricId, dimension_value};

/// The aggregation functions Metrics Insights knows (`SELECT` and `ORDER BY`).
pub const FUNCTIONS: [&str; 5] = ["AVG", "COUNT", "MAX", "MIN", "SUM"];

/// The most time series one query returns (CloudWatch's limit; `ORDER BY` decides which).
pub const MAX_SERIES: u64 = 500;

/// One `WHERE` condition: `key = 'value'` or `key != 'value'`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Filter {
    pub key: String,
    /// `=` (true) or `!=` (false).
    pub equal: bool,
    pub value: FunctionDimension,
}

/// A parsed query. Two queries are equal when they read the same metric the same way, however they are spelt
/// (case of keywords, spacing, quoting, order of the `SCHEMA` keys and of the `WHERE` conditions).
#[derive(Debug, Clone)]
pub struct InsightsQuery {
    /// `MAX`, `SUM`, ... (upper case).
    pub function: String,
    /// The metric name.
    pub metric: String,
    pub namespace: String,
    /// The dimension keys of `SCHEMA(...)`; `None` for `FROM <namespace>` (any dimensions).
    pub schema: Option<BTreeSet<String>>,
    pub filters: BTreeSet<Filter>,
    pub group_by: Vec<String>,
    /// `ORDER BY <function>() [ASC|DESC]`: the function and whether descending.
    pub order_by: Option<(String, bool)>,
    pub limit: Option<u64>,
    /// Label keys written without double quotes (not part of the comparison).
    pub bare_keys: BTreeSet<String>,
}

impl PartialEq for InsightsQuery {
    fn eq(&self, other: &Self) -> bool {
        (
            &self.function,
            &self.metric,
            &self.namespace,
            &self.schema,
            &self.filters,
            &self.group_by,
            &self.order_by,
            self.limit,
        ) == (
            &other.function,
            &other.metric,
            &other.namespace,
            &other.schema,
            &other.filters,
            &other.group_by,
            &other.order_by,
            other.limit,
        )
    }
}

impl Eq for InsightsQuery {}

fn value_text(v: &FunctionDimension) -> String {
    match v {
        FunctionDimension::FunctionRef(id) => format!("'!Ref {id}'"),
        FunctionDimension::Literal(s) => format!("'{s}'"),
    }
}

impl fmt::Display for InsightsQuery {
    /// The normalised text: every identifier in double quotes, keys in sorted order.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SELECT {}({:?}) FROM ", self.function, self.metric)?;
        match &self.schema {
            Some(keys) => {
                write!(f, "SCHEMA({:?}", self.namespace)?;
                for k in keys {
                    write!(f, ", {k:?}")?;
                }
                write!(f, ")")?;
            }
            None => write!(f, "{:?}", self.namespace)?,
        }
        for (i, c) in self.filters.iter().enumerate() {
            let op = if c.equal { "=" } else { "!=" };
            let word = if i == 0 { "WHERE" } else { "AND" };
            write!(f, " {word} {:?} {op} {}", c.key, value_text(&c.value))?;
        }
        if !self.group_by.is_empty() {
            let keys: Vec<String> = self.group_by.iter().map(|k| format!("{k:?}")).collect();
            write!(f, " GROUP BY {}", keys.join(", "))?;
        }
        if let Some((function, desc)) = &self.order_by {
            write!(
                f,
                " ORDER BY {function}() {}",
                if *desc { "DESC" } else { "ASC" }
            )?;
        }
        if let Some(n) = self.limit {
            write!(f, " LIMIT {n}")?;
        }
        Ok(())
    }
}

impl InsightsQuery {
    /// Whether the query reads `m`: same namespace and name, exactly the `SCHEMA` keys as dimensions (any with no
    /// `SCHEMA`), and every `WHERE` condition true of its dimension values.
    pub fn matches(&self, m: &MetricId) -> bool {
        m.namespace == self.namespace
            && m.name == self.metric
            && self
                .schema
                .as_ref()
                .is_none_or(|keys| m.dimensions.keys().eq(keys.iter()))
            && self.filters.iter().all(|c| {
                m.dimensions
                    .get(&c.key)
                    .is_some_and(|v| (*v == c.value) == c.equal)
            })
    }

    /// The metrics of `printed` the query reads.
    pub fn reads<'a>(&self, printed: impl IntoIterator<Item = &'a MetricId>) -> Vec<&'a MetricId> {
        printed.into_iter().filter(|m| self.matches(m)).collect()
    }

    /// What is wrong with the query, given the metrics the functions print (empty: nothing): it names no
    /// dimension set, leaves a label key unquoted, filters or groups by a key its `SCHEMA` lacks, or reads no
    /// printed metric.
    pub fn problems<'a>(&self, printed: impl IntoIterator<Item = &'a MetricId>) -> Vec<String> {
        let mut out = Vec::new();
        let keys = match &self.schema {
            Some(keys) => keys.clone(),
            None => {
                out.push(format!(
                    "{self} reads FROM a namespace, not SCHEMA(...): it would match {} under any dimensions, so \
                     it cannot be checked against the printed ones",
                    self.metric
                ));
                BTreeSet::new()
            }
        };
        if !self.bare_keys.is_empty() {
            out.push(format!(
                "{self}: the label keys {:?} are not in double quotes (Metrics Insights reserves FUNCTION, \
                 SUBSCRIBER and some 700 other words as keywords; quote every key)",
                self.bare_keys
            ));
        }
        for key in self
            .filters
            .iter()
            .map(|c| &c.key)
            .chain(self.group_by.iter())
        {
            if self.schema.is_some() && !keys.contains(key) {
                out.push(format!(
                    "{self} filters or groups by {key:?}, which is not a key of its SCHEMA"
                ));
            }
        }
        if let Some(n) = self.limit
            && !(1..=MAX_SERIES).contains(&n)
        {
            out.push(format!("{self}: LIMIT {n} is outside 1..={MAX_SERIES}"));
        }
        let printed: Vec<&MetricId> = printed.into_iter().collect();
        if self.reads(printed.iter().copied()).is_empty() {
            let same_name: Vec<String> = printed
                .iter()
                .filter(|p| p.name == self.metric)
                .map(ToString::to_string)
                .collect();
            out.push(format!(
                "{self} reads no metric any function prints (printed under that name: {same_name:?})"
            ));
        }
        out
    }
}

/// Whether an expression is a Metrics Insights query (it starts with `SELECT`) rather than metric math.
pub fn is_query(expression: &str) -> bool {
    expression
        .split_whitespace()
        .next()
        .is_some_and(|w| w.eq_ignore_ascii_case("SELECT"))
}

#[derive(Debug, Clone, PartialEq)]
enum Token {
    /// An unquoted word: a keyword or an identifier.
    Word(String),
    /// A double-quoted identifier.
    Quoted(String),
    /// A single-quoted label value.
    Value(String),
    Open,
    Close,
    Comma,
    Equal,
    NotEqual,
}

impl fmt::Display for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Token::Word(w) => write!(f, "{w}"),
            Token::Quoted(q) => write!(f, "{q:?}"),
            Token::Value(v) => write!(f, "'{v}'"),
            Token::Open => write!(f, "("),
            Token::Close => write!(f, ")"),
            Token::Comma => write!(f, ","),
            Token::Equal => write!(f, "="),
            Token::NotEqual => write!(f, "!="),
        }
    }
}

fn tokens(text: &str) -> Result<Vec<Token>, String> {
    let mut out = Vec::new();
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            c if c.is_whitespace() => {}
            '(' => out.push(Token::Open),
            ')' => out.push(Token::Close),
            ',' => out.push(Token::Comma),
            '=' => out.push(Token::Equal),
            '!' if chars.peek() == Some(&'=') => {
                chars.next();
                out.push(Token::NotEqual);
            }
            '"' | '\'' => {
                let mut s = String::new();
                loop {
                    match chars.next() {
                        Some('\\') => match chars.next() {
                            Some(e) => s.push(e),
                            None => return Err(format!("a {c} quote is not closed")),
                        },
                        Some(q) if q == c => break,
                        Some(other) => s.push(other),
                        None => return Err(format!("a {c} quote is not closed")),
                    }
                }
                out.push(if c == '"' {
                    Token::Quoted(s)
                } else {
                    Token::Value(s)
                });
            }
            c if c.is_ascii_alphanumeric() || c == '_' || c == '.' => {
                let mut w = String::from(c);
                while let Some(&n) = chars.peek() {
                    if n.is_ascii_alphanumeric() || n == '_' || n == '.' {
                        w.push(n);
                        chars.next();
                    } else {
                        break;
                    }
                }
                out.push(Token::Word(w));
            }
            other => return Err(format!("unexpected character {other:?}")),
        }
    }
    Ok(out)
}

struct Parser {
    tokens: Vec<Token>,
    at: usize,
    bare_keys: BTreeSet<String>,
}

impl Parser {
    fn peek(&self) -> Option<&Token> {
        self.tokens.get(self.at)
    }

    fn next(&mut self, what: &str) -> Result<Token, String> {
        let t = self
            .tokens
            .get(self.at)
            .cloned()
            .ok_or_else(|| format!("the query ends where {what} is expected"))?;
        self.at += 1;
        Ok(t)
    }

    fn is_keyword(&self, keyword: &str) -> bool {
        matches!(self.peek(), Some(Token::Word(w)) if w.eq_ignore_ascii_case(keyword))
    }

    fn keyword(&mut self, keyword: &str) -> Result<(), String> {
        match self.next(keyword)? {
            Token::Word(w) if w.eq_ignore_ascii_case(keyword) => Ok(()),
            other => Err(format!("{keyword} expected, found {other}")),
        }
    }

    fn token(&mut self, want: Token) -> Result<(), String> {
        let found = self.next(&want.to_string())?;
        if found == want {
            Ok(())
        } else {
            Err(format!("{want} expected, found {found}"))
        }
    }

    fn function(&mut self) -> Result<String, String> {
        match self.next("a function")? {
            Token::Word(w) if FUNCTIONS.contains(&w.to_uppercase().as_str()) => {
                Ok(w.to_uppercase())
            }
            other => Err(format!("one of {FUNCTIONS:?} expected, found {other}")),
        }
    }

    fn identifier(&mut self, what: &str) -> Result<(String, bool), String> {
        match self.next(what)? {
            Token::Word(w) => Ok((w, false)),
            Token::Quoted(q) => Ok((q, true)),
            other => Err(format!("{what} expected, found {other}")),
        }
    }

    /// A label key; an unquoted one is remembered.
    fn key(&mut self) -> Result<String, String> {
        let (key, quoted) = self.identifier("a label key")?;
        if !quoted {
            self.bare_keys.insert(key.clone());
        }
        Ok(key)
    }

    fn keys(&mut self) -> Result<Vec<String>, String> {
        let mut keys = vec![self.key()?];
        while self.peek() == Some(&Token::Comma) {
            self.at += 1;
            keys.push(self.key()?);
        }
        Ok(keys)
    }
}

/// Parses a Metrics Insights query (the grammar is in the module's documentation).
pub fn parse(text: &str) -> Result<InsightsQuery, String> {
    let mut p = Parser {
        tokens: tokens(text)?,
        at: 0,
        bare_keys: BTreeSet::new(),
    };
    p.keyword("SELECT")?;
    let function = p.function()?;
    p.token(Token::Open)?;
    let (metric, _) = p.identifier("a metric name")?;
    p.token(Token::Close)?;
    p.keyword("FROM")?;
    let (namespace, schema) = if p.is_keyword("SCHEMA") {
        p.at += 1;
        p.token(Token::Open)?;
        let (namespace, _) = p.identifier("a namespace")?;
        let mut keys = BTreeSet::new();
        while p.peek() == Some(&Token::Comma) {
            p.at += 1;
            let key = p.key()?;
            if !keys.insert(key.clone()) {
                return Err(format!("SCHEMA names {key:?} twice"));
            }
        }
        p.token(Token::Close)?;
        (namespace, Some(keys))
    } else {
        (p.identifier("a namespace or SCHEMA(...)")?.0, None)
    };
    let mut filters = BTreeSet::new();
    if p.is_keyword("WHERE") {
        p.at += 1;
        loop {
            let key = p.key()?;
            let equal = match p.next("= or !=")? {
                Token::Equal => true,
                Token::NotEqual => false,
                other => return Err(format!("= or != expected after {key}, found {other}")),
            };
            let value = match p.next("a label value")? {
                Token::Value(v) => dimension_value(&v),
                other => {
                    return Err(format!(
                        "a label value in single quotes expected after {key}, found {other}"
                    ));
                }
            };
            filters.insert(Filter { key, equal, value });
            if p.is_keyword("AND") {
                p.at += 1;
            } else {
                break;
            }
        }
    }
    let mut group_by = Vec::new();
    if p.is_keyword("GROUP") {
        p.at += 1;
        p.keyword("BY")?;
        group_by = p.keys()?;
    }
    let mut order_by = None;
    if p.is_keyword("ORDER") {
        p.at += 1;
        p.keyword("BY")?;
        let function = p.function()?;
        p.token(Token::Open)?;
        p.token(Token::Close)?;
        let desc = if p.is_keyword("DESC") {
            p.at += 1;
            true
        } else {
            if p.is_keyword("ASC") {
                p.at += 1;
            }
            false
        };
        order_by = Some((function, desc));
    }
    let mut limit = None;
    if p.is_keyword("LIMIT") {
        p.at += 1;
        limit = Some(match p.next("a number")? {
            Token::Word(w) => w
                .parse::<u64>()
                .map_err(|_| format!("LIMIT takes a number, not {w}"))?,
            other => return Err(format!("LIMIT takes a number, not {other}")),
        });
    }
    if let Some(rest) = p.peek() {
        return Err(format!("unexpected {rest} after the query's last clause"));
    }
    Ok(InsightsQuery {
        function,
        metric,
        namespace,
        schema,
        filters,
        group_by,
        order_by,
        limit,
        bare_keys: p.bare_keys,
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn metric(name: &str, dims: &[(&str, FunctionDimension)]) -> MetricId {
        MetricId {
            namespace: "Outbox".into(),
            name: name.into(),
            dimensions: dims
                .iter()
                .map(|(k, v)| ((*k).to_owned(), v.clone()))
                .collect::<BTreeMap<_, _>>(),
        }
    }

    #[test]
    fn parses_every_clause_and_compares_normalised() {
        let q = parse(
            r#"SELECT MAX(SubscriberOldestPendingAge) FROM SCHEMA("Outbox", "Function", "Subscriber", "Topic")
               WHERE "Function" = '@ref:RelayFunction@' GROUP BY "Topic", "Subscriber" ORDER BY MAX() DESC LIMIT 10"#,
        )
        .unwrap();
        assert_eq!(q.function, "MAX");
        assert_eq!(q.metric, "SubscriberOldestPendingAge");
        assert_eq!(q.namespace, "Outbox");
        assert_eq!(
            q.schema,
            Some(BTreeSet::from(
                ["Function", "Subscriber", "Topic"].map(String::from)
            ))
        );
        assert_eq!(
            q.filters,
            BTreeSet::from([Filter {
                key: "Function".into(),
                equal: true,
                value: FunctionDimension::FunctionRef("RelayFunction".into()),
            }])
        );
        assert_eq!(q.group_by, ["Topic", "Subscriber"]);
        assert_eq!(q.order_by, Some(("MAX".into(), true)));
        assert_eq!(q.limit, Some(10));
        assert!(q.bare_keys.is_empty());
        // Spelling does not matter; what is read does.
        let same = parse(
            "select max(\"SubscriberOldestPendingAge\") from schema(Outbox, Topic, Subscriber, Function) \
             where Function = '@ref:RelayFunction@' group by Topic, Subscriber order by max() desc limit 10",
        )
        .unwrap();
        assert_eq!(q, same);
        assert_eq!(
            same.bare_keys,
            BTreeSet::from(["Function", "Subscriber", "Topic"].map(String::from))
        );
        assert_ne!(
            q,
            parse(&q.to_string().replace("ORDER BY MAX() DESC", "")).unwrap()
        );
        // The normalised text parses back to the same query.
        assert_eq!(
            parse(
                &q.to_string()
                    .replace("'!Ref RelayFunction'", "'@ref:RelayFunction@'")
            )
            .unwrap(),
            q
        );
    }

    #[test]
    fn refuses_what_is_not_a_query() {
        for bad in [
            "SELEC MAX(m) FROM SCHEMA(\"Outbox\")",
            "SELECT P99(m) FROM SCHEMA(\"Outbox\")",
            "SELECT MAX(m) SCHEMA(\"Outbox\")",
            "SELECT MAX(m) FROM SCHEMA(\"Outbox\", k, k)",
            "SELECT MAX(m) FROM SCHEMA(\"Outbox\", k) WHERE k = v",
            "SELECT MAX(m) FROM SCHEMA(\"Outbox\", k) WHERE k = 'v' GROUP k",
            "SELECT MAX(m) FROM SCHEMA(\"Outbox\", k) LIMIT many",
            "SELECT MAX(m) FROM SCHEMA(\"Outbox\", k) trailing",
            "SELECT MAX(m) FROM SCHEMA(\"Outbox, k)",
        ] {
            assert!(parse(bad).is_err(), "{bad} parsed");
        }
    }

    #[test]
    fn matches_exactly_the_schema_and_the_conditions() {
        let relay = FunctionDimension::FunctionRef("RelayFunction".into());
        let lit = |s: &str| FunctionDimension::Literal(s.into());
        let q = parse(
            r#"SELECT MAX(SubscriberPending) FROM SCHEMA("Outbox", "Function", "Topic", "Subscriber")
               WHERE "Function" = '@ref:RelayFunction@' AND "Subscriber" != 'default'"#,
        )
        .unwrap();
        let billing = metric(
            "SubscriberPending",
            &[
                ("Function", relay.clone()),
                ("Topic", lit("orders")),
                ("Subscriber", lit("billing")),
            ],
        );
        assert!(q.matches(&billing));
        let mut default = billing.clone();
        default
            .dimensions
            .insert("Subscriber".into(), lit("default"));
        assert!(!q.matches(&default));
        let mut other_function = billing.clone();
        other_function
            .dimensions
            .insert("Function".into(), lit("consumer"));
        assert!(!q.matches(&other_function));
        let mut fewer = billing.clone();
        fewer.dimensions.remove("Topic");
        assert!(!q.matches(&fewer));
        let mut renamed = billing.clone();
        renamed.name = "SubscriberPendingCount".into();
        assert!(!q.matches(&renamed));

        let printed = [billing.clone()];
        assert!(
            q.problems(&printed).is_empty(),
            "{:?}",
            q.problems(&printed)
        );
        assert!(!q.problems(&[default]).is_empty());
        // Unquoted keys, a grouping key outside the schema, no schema at all: each is a problem.
        for (text, says) in [
            (
                "SELECT MAX(SubscriberPending) FROM SCHEMA(\"Outbox\", Function, \"Topic\", \"Subscriber\")",
                "not in double quotes",
            ),
            (
                "SELECT MAX(SubscriberPending) FROM SCHEMA(\"Outbox\", \"Function\", \"Topic\", \"Subscriber\") \
                 GROUP BY \"Queue\"",
                "not a key of its SCHEMA",
            ),
            (
                "SELECT MAX(SubscriberPending) FROM \"Outbox\"",
                "not SCHEMA",
            ),
        ] {
            let problems = parse(text).unwrap().problems(&printed);
            assert!(
                problems.iter().any(|p| p.contains(says)),
                "{text}: {problems:?}"
            );
        }
    }
}
