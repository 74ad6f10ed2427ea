//! `Upstash-Retry-Delay` expressions: a tiny, safe arithmetic language.
//!
//! Grammar (whitespace ignored):
//! ```text
//! expr   := term (('+' | '-') term)*
//! term   := unary (('*' | '/') unary)*
//! unary  := '-' unary | '+' unary | atom
//! atom   := number | 'retried' | func '(' expr (',' expr)* ')' | '(' expr ')'
//! func   := pow | exp | sqrt | abs | floor | ceil | round | min | max
//! ```
//! The result is a delay in milliseconds. Evaluation never panics; non-finite results are handled by the caller.

use std::fmt;

#[derive(Clone, Debug, PartialEq)]
enum Node {
    Num(f64),
    Retried,
    Neg(Box<Node>),
    Bin(Op, Box<Node>, Box<Node>),
    Call(Func, Vec<Node>),
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Op {
    Add,
    Sub,
    Mul,
    Div,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Func {
    Pow,
    Exp,
    Sqrt,
    Abs,
    Floor,
    Ceil,
    Round,
    Min,
    Max,
}

impl Func {
    fn from_name(name: &str) -> Option<Func> {
        Some(match name {
            "pow" => Func::Pow,
            "exp" => Func::Exp,
            "sqrt" => Func::Sqrt,
            "abs" => Func::Abs,
            "floor" => Func::Floor,
            "ceil" => Func::Ceil,
            "round" => Func::Round,
            "min" => Func::Min,
            "max" => Func::Max,
            _ => return None,
        })
    }
    fn arity(self) -> usize {
        match self {
            Func::Pow | Func::Min | Func::Max => 2,
            _ => 1,
        }
    }
}

/// A parsed retry-delay expression together with its source text (reported as `retryDelayExpression`).
#[derive(Clone, Debug, PartialEq)]
pub struct RetryDelayExpr {
    source: String,
    root: Node,
}

/// Why an expression was rejected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExprError(pub String);

impl fmt::Display for ExprError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ExprError {}

const MAX_DEPTH: usize = 64;

impl RetryDelayExpr {
    /// Parses `source`; rejects unknown identifiers, wrong arities, trailing input and absurd nesting.
    pub fn parse(source: &str) -> Result<RetryDelayExpr, ExprError> {
        if source.len() > 1024 {
            return Err(ExprError("expression too long".into()));
        }
        let tokens = tokenize(source)?;
        let mut p = Parser {
            tokens: &tokens,
            pos: 0,
            depth: 0,
        };
        let root = p.expr()?;
        if p.pos != tokens.len() {
            return Err(ExprError(format!(
                "unexpected {} at token {}",
                tokens[p.pos].describe(),
                p.pos + 1
            )));
        }
        Ok(RetryDelayExpr {
            source: source.to_string(),
            root,
        })
    }

    /// The expression as given.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Evaluates with `retried` bound (0 for the first retry). The result may be negative or non-finite.
    pub fn eval(&self, retried: f64) -> f64 {
        eval(&self.root, retried)
    }

    /// The wait before a retry, from the expression's milliseconds with `retried` bound (0 for the first retry):
    /// NaN and negative values wait nothing, values above `max` or too large for a `Duration` wait `max`.
    pub fn delay(&self, retried: u32, max: std::time::Duration) -> std::time::Duration {
        let ms = self.eval(f64::from(retried));
        let ms = if ms.is_nan() || ms < 0.0 { 0.0 } else { ms };
        std::time::Duration::try_from_secs_f64(ms / 1000.0)
            .unwrap_or(max)
            .min(max)
    }
}

fn eval(node: &Node, retried: f64) -> f64 {
    match node {
        Node::Num(n) => *n,
        Node::Retried => retried,
        Node::Neg(inner) => -eval(inner, retried),
        Node::Bin(op, a, b) => {
            let (a, b) = (eval(a, retried), eval(b, retried));
            match op {
                Op::Add => a + b,
                Op::Sub => a - b,
                Op::Mul => a * b,
                Op::Div => a / b,
            }
        }
        Node::Call(f, args) => {
            let a = args.first().map(|n| eval(n, retried)).unwrap_or(f64::NAN);
            let b = args.get(1).map(|n| eval(n, retried)).unwrap_or(f64::NAN);
            match f {
                Func::Pow => a.powf(b),
                Func::Exp => a.exp(),
                Func::Sqrt => a.sqrt(),
                Func::Abs => a.abs(),
                Func::Floor => a.floor(),
                Func::Ceil => a.ceil(),
                Func::Round => a.round(),
                Func::Min => a.min(b),
                Func::Max => a.max(b),
            }
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Num(f64),
    Ident(String),
    Plus,
    Minus,
    Star,
    Slash,
    LParen,
    RParen,
    Comma,
}

impl Tok {
    fn describe(&self) -> String {
        match self {
            Tok::Num(n) => format!("number {n}"),
            Tok::Ident(s) => format!("identifier {s:?}"),
            Tok::Plus => "'+'".into(),
            Tok::Minus => "'-'".into(),
            Tok::Star => "'*'".into(),
            Tok::Slash => "'/'".into(),
            Tok::LParen => "'('".into(),
            Tok::RParen => "')'".into(),
            Tok::Comma => "','".into(),
        }
    }
}

fn tokenize(s: &str) -> Result<Vec<Tok>, ExprError> {
    let bytes = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        match c {
            b' ' | b'\t' | b'\n' | b'\r' => i += 1,
            b'+' => {
                out.push(Tok::Plus);
                i += 1
            }
            b'-' => {
                out.push(Tok::Minus);
                i += 1
            }
            b'*' => {
                out.push(Tok::Star);
                i += 1
            }
            b'/' => {
                out.push(Tok::Slash);
                i += 1
            }
            b'(' => {
                out.push(Tok::LParen);
                i += 1
            }
            b')' => {
                out.push(Tok::RParen);
                i += 1
            }
            b',' => {
                out.push(Tok::Comma);
                i += 1
            }
            b'0'..=b'9' | b'.' => {
                let start = i;
                while i < bytes.len() && (bytes[i].is_ascii_digit() || bytes[i] == b'.') {
                    i += 1;
                }
                // optional exponent: 1e3, 2.5E-2
                if i < bytes.len() && (bytes[i] == b'e' || bytes[i] == b'E') {
                    let save = i;
                    i += 1;
                    if i < bytes.len() && (bytes[i] == b'+' || bytes[i] == b'-') {
                        i += 1;
                    }
                    if i < bytes.len() && bytes[i].is_ascii_digit() {
                        while i < bytes.len() && bytes[i].is_ascii_digit() {
                            i += 1;
                        }
                    } else {
                        i = save;
                    }
                }
                let text = &s[start..i];
                let n: f64 = text
                    .parse()
                    .map_err(|_| ExprError(format!("invalid number {text:?}")))?;
                out.push(Tok::Num(n));
            }
            c if c.is_ascii_alphabetic() || c == b'_' => {
                let start = i;
                while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
                    i += 1;
                }
                out.push(Tok::Ident(s[start..i].to_string()));
            }
            _ => {
                let ch = s[i..].chars().next().unwrap_or('?');
                return Err(ExprError(format!("unexpected character {ch:?}")));
            }
        }
    }
    if out.is_empty() {
        return Err(ExprError("empty expression".into()));
    }
    Ok(out)
}

struct Parser<'a> {
    tokens: &'a [Tok],
    pos: usize,
    depth: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<&Tok> {
        self.tokens.get(self.pos)
    }

    fn next(&mut self) -> Option<&Tok> {
        let t = self.tokens.get(self.pos);
        self.pos += 1;
        t
    }

    fn expect(&mut self, want: &Tok) -> Result<(), ExprError> {
        match self.next() {
            Some(t) if t == want => Ok(()),
            Some(t) => Err(ExprError(format!(
                "expected {}, found {}",
                want.describe(),
                t.describe()
            ))),
            None => Err(ExprError(format!(
                "expected {}, found end of expression",
                want.describe()
            ))),
        }
    }

    fn enter(&mut self) -> Result<(), ExprError> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(ExprError("expression nested too deeply".into()));
        }
        Ok(())
    }

    fn expr(&mut self) -> Result<Node, ExprError> {
        self.enter()?;
        let mut left = self.term()?;
        loop {
            let op = match self.peek() {
                Some(Tok::Plus) => Op::Add,
                Some(Tok::Minus) => Op::Sub,
                _ => break,
            };
            self.pos += 1;
            let right = self.term()?;
            left = Node::Bin(op, Box::new(left), Box::new(right));
        }
        self.depth -= 1;
        Ok(left)
    }

    fn term(&mut self) -> Result<Node, ExprError> {
        let mut left = self.unary()?;
        loop {
            let op = match self.peek() {
                Some(Tok::Star) => Op::Mul,
                Some(Tok::Slash) => Op::Div,
                _ => break,
            };
            self.pos += 1;
            let right = self.unary()?;
            left = Node::Bin(op, Box::new(left), Box::new(right));
        }
        Ok(left)
    }

    fn unary(&mut self) -> Result<Node, ExprError> {
        match self.peek() {
            Some(Tok::Minus) => {
                self.pos += 1;
                self.enter()?;
                let inner = self.unary()?;
                self.depth -= 1;
                Ok(Node::Neg(Box::new(inner)))
            }
            Some(Tok::Plus) => {
                self.pos += 1;
                self.enter()?;
                let inner = self.unary()?;
                self.depth -= 1;
                Ok(inner)
            }
            _ => self.atom(),
        }
    }

    fn atom(&mut self) -> Result<Node, ExprError> {
        match self.next().cloned() {
            Some(Tok::Num(n)) => Ok(Node::Num(n)),
            Some(Tok::LParen) => {
                let inner = self.expr()?;
                self.expect(&Tok::RParen)?;
                Ok(inner)
            }
            Some(Tok::Ident(name)) => {
                if name == "retried" {
                    return Ok(Node::Retried);
                }
                let func = Func::from_name(&name)
                    .ok_or_else(|| ExprError(format!("unknown identifier {name:?}")))?;
                self.expect(&Tok::LParen)?;
                let mut args = vec![self.expr()?];
                while self.peek() == Some(&Tok::Comma) {
                    self.pos += 1;
                    args.push(self.expr()?);
                }
                self.expect(&Tok::RParen)?;
                if args.len() != func.arity() {
                    return Err(ExprError(format!(
                        "{name} takes {} argument(s), got {}",
                        func.arity(),
                        args.len()
                    )));
                }
                Ok(Node::Call(func, args))
            }
            Some(t) => Err(ExprError(format!("unexpected {}", t.describe()))),
            None => Err(ExprError("unexpected end of expression".into())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(s: &str, r: f64) -> f64 {
        RetryDelayExpr::parse(s).unwrap().eval(r)
    }

    #[test]
    fn documented_examples() {
        assert_eq!(ev("1000", 3.0), 1000.0);
        assert_eq!(ev("1000 * (1 + retried)", 2.0), 3000.0);
        assert_eq!(ev("pow(2, retried) * 1000", 3.0), 8000.0);
        assert_eq!(ev("max(1000, pow(2, retried) * 100)", 0.0), 1000.0);
        assert_eq!(ev("max(1000, pow(2, retried) * 100)", 5.0), 3200.0);
    }

    #[test]
    fn precedence_unary_and_functions() {
        assert_eq!(ev("1 + 2 * 3", 0.0), 7.0);
        assert_eq!(ev("(1 + 2) * 3", 0.0), 9.0);
        assert_eq!(ev("10 - 4 - 3", 0.0), 3.0);
        assert_eq!(ev("-retried + 5", 2.0), 3.0);
        assert_eq!(ev("--2", 0.0), 2.0);
        assert_eq!(ev("2 * -3", 0.0), -6.0);
        assert_eq!(
            ev(
                "sqrt(16) + abs(-2) + floor(1.7) + ceil(1.2) + round(2.5)",
                0.0
            ),
            4.0 + 2.0 + 1.0 + 2.0 + 3.0
        );
        assert_eq!(ev("min(3, retried)", 7.0), 3.0);
        assert!((ev("exp(1)", 0.0) - std::f64::consts::E).abs() < 1e-12);
        assert_eq!(ev("1e3 / 4", 0.0), 250.0);
    }

    #[test]
    fn rejects_garbage() {
        for bad in [
            "",
            "retried +",
            "foo(1)",
            "pow(1)",
            "max(1,2,3)",
            "1 2",
            "(1",
            "1)",
            "retried; drop",
            "sqrt 4",
            "1..2",
            "x",
        ] {
            assert!(
                RetryDelayExpr::parse(bad).is_err(),
                "{bad:?} should be rejected"
            );
        }
        let deep = format!("{}1{}", "(".repeat(200), ")".repeat(200));
        assert!(RetryDelayExpr::parse(&deep).is_err());
    }
}
