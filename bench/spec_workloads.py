"""The prompt sets of ``bench.spec_decode``: chat conversations, written here (no download).

- ``grounded``: an edit of a source text given in the prompt (correct its
  typos, add docstrings, convert a table, list the names and dates in it).
  The answer copies long runs of the prompt, which is what draft lookups find.
  Six sources of 300 to 800 tokens (prose, code, a table, meeting notes),
  each under two or three instructions.
- ``repeat``: one templated task over different records, so that the outputs
  share their form and only the values change: what a cache of earlier
  outputs (``suffix``) finds and the request's own prompt mostly does not.
- ``free``: open questions with no source text; drafts find little.

Each prompt is a list of chat messages; ``bench.spec_decode`` applies the
model's chat template.
"""

from __future__ import annotations

LIGHTHOUSES = """\
Lighthouses have guided sailors for more then two thousand years. The earliest known lighthouse, the Pharos of \
Alexandria, was built in the third century BC and stood for over a thousand years before earthquakes brougth it \
down. Its fire was said to be visible from fifty kilometres out to sea, although historians doubt that figure.

For most of their history, lighthouses burned wood, coal or oil in open fires. These fires were hard to tend and \
gave a weak, flickering light. In the eighteenth century, the Argand lamp, wich used a hollow wick and a glass \
chimney, made the flame brighter and steadier. Reflectors made of polished metal were placed behind the lamps so \
that more of the ligth was sent out over the water.

The great change came in 1822, when the French physicist Augustin Fresnel designed a new kind of lens. Instead of \
one thick piece of glass, the Fresnel lens used rings of prisms arranged around a central lens. It was lighter, \
cheaper and far more efficent than a solid lens of the same size. A lighthouse fitted with a Fresnel lens could be \
seen more than thirty kilometres away, and within a few decades the design was used on coasts all over the world.

Each lighthouse was given its own pattern of flashes, called its characteristic, so that sailors could tell one \
light from another at night. A light might flash twice every ten seconds, or show a steady beam interrupted by a \
short eclipse. Sailors carried lists of these patterns and compared them with what they saw from the deck.

The life of a lighthouse keeper was lonely and hard. Keepers had to climb the tower many times a night to trim the \
wicks, wind the clockwork that turned the lens, and clean the soot from the glass. On remote rocks, supplies arrived \
by boat, and storms could cut a station off for weeks. Many keepers lived with their familys in small cottages at \
the foot of the tower.

During the twentieth century, electric lamps replaced oil, and automatic systems replaced the keepers. Today most \
lighthouses are controled remotely, and satellite navigation has made them less important than they once were. \
Still, many are kept running as a backup, and many more have become museums, reminding visitors of the people who \
once kept the lights burning through the longest nights of the year.
"""

RAILWAY = """\
The town of Millbrook grew up around its railway station. Before the line arrived, Millbrook was a village of a few \
hundred farmers on the banks of the river Wend. In March 1861, the engineer Thomas Hale surveyed a route for the \
Northern Valley Railway that ran straight through the village, and the directors approved his plan on 14 June 1861.

Construction began in the spring of 1862 under the contractor Samuel Price. Over four hundred workers, many of them \
from Ireland and Wales, dug the cuttings and built the long brick viaduct over the Wend. The work was slowed by a \
flood in November 1863, which washed away two of the viaduct's arches. Price was nearly ruined, but a loan from the \
banker Eleanor Marsh allowed him to finish the work.

The first train reached Millbrook on 2 September 1864. The mayor, George Atwood, gave a speech from the platform, \
and the brass band of the nearby town of Carlow played until the evening. Within ten years the population had \
tripled. A brewery, a tannery and two hotels opened near the station, and the weekly market became one of the \
largest in the county.

In 1889 the station was rebuilt in stone to a design by the architect Margaret Lowe, one of the few women working \
as an architect at the time. Her clock tower, finished on 1 May 1890, is still the tallest building in the town. \
The station master, William Grant, served from 1885 until his death in 1921, and a plaque on the platform records \
his name.

The railway declined after the Second World War. Freight moved to the roads, and the number of passengers fell each \
year. On 6 January 1964 the line was closed to passengers, and the last freight train ran on 30 October 1967. For \
two decades the station stood empty, its windows broken and its clock stopped at twenty past four.

In 1988 a group of residents led by the schoolteacher Ruth Okafor formed the Millbrook Station Trust. They raised \
money to repair the roof and the clock tower, and on 2 September 1994, exactly one hundred and thirty years after \
the first train, the station reopened as a museum and library. A short stretch of track was relaid in 2006, and on \
summer weekends a steam engine named Eleanor carries visitors across the viaduct and back.
"""

INVENTORY_CODE = '''\
import json
from dataclasses import dataclass, field


@dataclass
class Item:
    sku: str
    name: str
    price: float
    quantity: int = 0


@dataclass
class Inventory:
    items: dict = field(default_factory=dict)

    def add(self, item):
        if item.sku in self.items:
            self.items[item.sku].quantity += item.quantity
        else:
            self.items[item.sku] = item

    def remove(self, sku, quantity):
        item = self.items.get(sku)
        if item is None:
            raise KeyError(sku)
        if quantity > item.quantity:
            raise ValueError(f"only {item.quantity} of {sku} left")
        item.quantity -= quantity
        if item.quantity == 0:
            del self.items[sku]

    def total_value(self):
        return sum(item.price * item.quantity for item in self.items.values())

    def low_stock(self, threshold=5):
        return [item for item in self.items.values() if item.quantity < threshold]

    def find(self, text):
        text = text.lower()
        return [item for item in self.items.values() if text in item.name.lower()]


def load_inventory(path):
    with open(path) as f:
        rows = json.load(f)
    inventory = Inventory()
    for row in rows:
        inventory.add(Item(row["sku"], row["name"], float(row["price"]), int(row["quantity"])))
    return inventory


def save_inventory(inventory, path):
    rows = [
        {"sku": item.sku, "name": item.name, "price": item.price, "quantity": item.quantity}
        for item in inventory.items.values()
    ]
    with open(path, "w") as f:
        json.dump(rows, f, indent=2)


def apply_discount(inventory, percent):
    for item in inventory.items.values():
        item.price = round(item.price * (1 - percent / 100), 2)


def report(inventory):
    lines = []
    for item in sorted(inventory.items.values(), key=lambda item: item.name):
        lines.append(f"{item.sku:8} {item.name:24} {item.quantity:5} {item.price:8.2f}")
    lines.append(f"total value: {inventory.total_value():.2f}")
    return "\\n".join(lines)
'''

TEXT_STATS_CODE = '''\
function wordCount(text) {
  return text.split(/\\s+/).filter((word) => word.length > 0).length;
}

function sentenceCount(text) {
  const sentences = text.split(/[.!?]+/).filter((s) => s.trim().length > 0);
  return sentences.length;
}

function wordFrequencies(text) {
  const counts = new Map();
  for (const word of text.toLowerCase().match(/[a-z']+/g) || []) {
    counts.set(word, (counts.get(word) || 0) + 1);
  }
  return counts;
}

function topWords(text, n) {
  const counts = wordFrequencies(text);
  return [...counts.entries()]
    .sort((a, b) => b[1] - a[1] || a[0].localeCompare(b[0]))
    .slice(0, n)
    .map(([word, count]) => ({ word, count }));
}

function averageWordLength(text) {
  const words = text.match(/[A-Za-z']+/g) || [];
  if (words.length === 0) {
    return 0;
  }
  const total = words.reduce((sum, word) => sum + word.length, 0);
  return total / words.length;
}

function readingTimeMinutes(text, wordsPerMinute = 200) {
  return Math.ceil(wordCount(text) / wordsPerMinute);
}

function longestSentence(text) {
  const sentences = text.split(/(?<=[.!?])\\s+/);
  let longest = "";
  for (const sentence of sentences) {
    if (sentence.length > longest.length) {
      longest = sentence;
    }
  }
  return longest.trim();
}

function summarize(text) {
  return {
    words: wordCount(text),
    sentences: sentenceCount(text),
    averageWordLength: averageWordLength(text).toFixed(2),
    readingTime: readingTimeMinutes(text),
    topWords: topWords(text, 5),
    longestSentence: longestSentence(text),
  };
}

module.exports = { wordCount, sentenceCount, topWords, averageWordLength, readingTimeMinutes, summarize };
'''

PLANETS_TABLE = """\
| Body | Type | Diameter (km) | Distance from Sun (million km) | Moons |
|---|---|---|---|---|
| Mercury | planet | 4879 | 57.9 | 0 |
| Venus | planet | 12104 | 108.2 | 0 |
| Earth | planet | 12756 | 149.6 | 1 |
| Mars | planet | 6792 | 227.9 | 2 |
| Ceres | dwarf planet | 939 | 413.7 | 0 |
| Jupiter | planet | 142984 | 778.6 | 95 |
| Saturn | planet | 120536 | 1433.5 | 146 |
| Uranus | planet | 51118 | 2872.5 | 28 |
| Neptune | planet | 49528 | 4495.1 | 16 |
| Pluto | dwarf planet | 2377 | 5906.4 | 5 |
| Haumea | dwarf planet | 1632 | 6452.0 | 2 |
| Makemake | dwarf planet | 1430 | 6850.0 | 1 |
| Eris | dwarf planet | 2326 | 10125.0 | 1 |
| Io | moon of Jupiter | 3643 | 778.6 | 0 |
| Europa | moon of Jupiter | 3122 | 778.6 | 0 |
| Ganymede | moon of Jupiter | 5268 | 778.6 | 0 |
| Callisto | moon of Jupiter | 4821 | 778.6 | 0 |
| Titan | moon of Saturn | 5150 | 1433.5 | 0 |
| Triton | moon of Neptune | 2707 | 4495.1 | 0 |
| Moon | moon of Earth | 3475 | 149.6 | 0 |
"""

MEETING_NOTES = """\
Project Harbor, weekly meeting, Tuesday 12 March 2024
Present: Anna Kowalski (chair), David Chen, Priya Raman, Lucas Moreau, Fatima Haddad, Tom Becker
Apologies: Sofia Alvarez

1. Release schedule
- The beta release moves from 18 March to 25 March because the payment tests are not finished.
- David Chen will tell the two pilot customers about the new date by Thursday 14 March.
- The public release stays on 15 April unless the beta finds a serious problem.

2. Payments
- Priya Raman reported that refunds fail when an order was paid in two parts.
- Lucas Moreau will write a fix and the tests for it by Friday 15 March.
- Priya Raman will review the fix on Monday 18 March and run the full payment suite.

3. Infrastructure
- The database upgrade to version 16 is planned for the night of Saturday 23 March.
- Fatima Haddad will prepare the rollback plan and share it by Wednesday 20 March.
- Tom Becker asked for a second person on call that night; Lucas Moreau volunteered.

4. Documentation
- The user guide is missing the new export feature.
- Sofia Alvarez (absent) had offered to write it; Anna Kowalski will confirm with her by email.
- The draft guide is due on Friday 22 March, and Tom Becker will proofread it.

5. Hiring
- Two candidates for the frontend role are in the final round.
- Interviews are on Tuesday 19 March with Anna Kowalski and David Chen.
- A decision is expected by Monday 25 March.

6. Any other business
- The team offsite is confirmed for 10 and 11 April in Lisbon.
- Fatima Haddad will book the rooms by 29 March.

Next meeting: Tuesday 19 March 2024, 10:00, same room.
"""

GROUNDED_TASKS = [
    ("Correct the typos in the following text and return it in full:", LIGHTHOUSES),
    ("Rewrite the following text in simple English, keeping every paragraph:", LIGHTHOUSES),
    ("Summarize each paragraph of the following text in one sentence:", LIGHTHOUSES),
    ("List every name and date mentioned in the text:", RAILWAY),
    ("Copy the following text and put every year in bold (**1864**):", RAILWAY),
    ("Answer from the text: who was involved in building the railway, and when did it open and close?", RAILWAY),
    ("Copy the following code and add a docstring to each function:", INVENTORY_CODE),
    ("Copy the following code and add type hints to every function:", INVENTORY_CODE),
    ("Explain what each function in the following code does:", INVENTORY_CODE),
    ("Copy the following JavaScript and add a comment above each function:", TEXT_STATS_CODE),
    ("Rewrite the following JavaScript in Python, function by function:", TEXT_STATS_CODE),
    ("Convert the following table to CSV:", PLANETS_TABLE),
    ("Copy the following table, keeping only the rows of planets and dwarf planets:", PLANETS_TABLE),
    ("Convert the following table to a JSON list of objects, one per row:", PLANETS_TABLE),
    ("List every person, with each task given to them and its date:", MEETING_NOTES),
    ("Rewrite the following meeting notes as a list of action items with owner and due date:", MEETING_NOTES),
]


def grounded() -> list[list[dict]]:
    return [[{"role": "user", "content": f"{task}\n\n{source}"}] for task, source in GROUNDED_TASKS]


FIRST_NAMES = ["Alice", "Bruno", "Chen", "Dmitri", "Elena", "Farah", "George", "Hana", "Ivan", "Julia", "Kofi",
               "Lena", "Mateo", "Nadia", "Omar", "Paula", "Quinn"]
LAST_NAMES = ["Smith", "Rossi", "Wang", "Petrov", "Garcia", "Khan", "Brown", "Sato", "Novak", "Meyer", "Mensah"]
CITIES = ["Paris", "Lagos", "Osaka", "Lima", "Oslo", "Cairo", "Denver", "Hanoi", "Porto", "Quebec", "Perth",
          "Seoul", "Nairobi"]
JOBS = ["teacher", "nurse", "pilot", "baker", "engineer", "farmer", "lawyer"]


def repeat(num_prompts: int = 50) -> list[list[dict]]:
    """``num_prompts`` records in one form, their values from coprime-length lists (no two alike under 1,000)."""
    prompts = []
    for i in range(num_prompts):
        record = (f"Name: {FIRST_NAMES[i % len(FIRST_NAMES)]} {LAST_NAMES[i % len(LAST_NAMES)]}; "
                  f"City: {CITIES[i % len(CITIES)]}; Age: {21 + (7 * i) % 53}; Job: {JOBS[i % len(JOBS)]}")
        prompts.append([{"role": "user", "content": "Convert this record to JSON with the keys name, city, age and "
                                                    f"job. Reply with the JSON only.\n\n{record}"}])
    return prompts


FREE_QUESTIONS = [
    "Tell me a story about a fox who wants to learn to fly.",
    "What are good habits for staying healthy while working at a desk?",
    "Why is the sky blue?",
    "Give me some tips for learning a new language.",
    "What should I pack for a weekend camping trip?",
    "Explain how a bicycle stays upright.",
    "Write a short poem about autumn rain.",
    "How do I make a simple tomato soup?",
    "What are the benefits of reading books?",
    "Describe a day in the life of a honeybee.",
    "How can I become better at managing my time?",
    "What is the difference between weather and climate?",
    "Tell me a story about a robot who finds a garden.",
    "Why do people enjoy music?",
    "What are some fun things to do on a rainy day?",
    "How does a plant grow from a seed?",
]


def free() -> list[list[dict]]:
    return [[{"role": "user", "content": question}] for question in FREE_QUESTIONS]


WORKLOADS = {"grounded": grounded, "repeat": repeat, "free": free}
